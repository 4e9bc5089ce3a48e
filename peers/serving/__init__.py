"""The serving domain: what a peer does with the requests its handlers (``peers.rpc``) pass on, whatever the
transport. The engine room (``engine``: the loaded runtime, the compute thread's scheduler (``scheduler``), queue
quota, limits and counters), the inference session table (``sessions``) and the forward and backward pass service
(``pass_service``) built on it; kept activations (``activations``), client adapters (``adapters``), the KV-cache
budget (``kv_cache``), input checks (``checks``), per-caller limits (``limits``) and request counters
(``counters``); and the ports the domain is driven through: the span runtime a stage loads (``runtime``), and the
stage itself with its learner and training handlers (``stage_port``, ``ports``)."""
