"""The client's token history inside a session: what ``generate`` is given is read as the whole conversation or as
its continuation, whichever it is."""

from __future__ import annotations

import torch

from swarm.client.session.history import TokenHistory


def test_the_last_output_given_back_as_it_was_is_the_whole_conversation() -> None:
    history = TokenHistory()
    history.conversation = torch.tensor([[5, 6, 7, 8]])
    ids, _ = history.generate_inputs(torch.tensor([[5, 6, 7, 8]]), {})
    assert ids.tolist() == [[5, 6, 7, 8]]  # not [[5, 6, 7, 8, 5, 6, 7, 8]]: nothing is sent twice
    ids, _ = history.generate_inputs(torch.tensor([[5, 6, 7, 8, 9]]), {})
    assert ids.tolist() == [[5, 6, 7, 8, 9]]
    ids, kwargs = history.generate_inputs(torch.tensor([[9, 10]]), {"attention_mask": torch.ones(1, 2)})
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]]  # a continuation is appended, with its mask
    assert kwargs["attention_mask"].shape == (1, 6)
