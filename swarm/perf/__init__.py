"""Performance and cost model: hardware catalogue, micro-benchmarks, predictions."""
