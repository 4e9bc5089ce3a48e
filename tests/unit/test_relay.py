"""Relayed addresses as p2pd reads them, and what a private peer's policy announces and asks its daemon for."""

from __future__ import annotations

import base58
import pytest
from hivemind.utils.multiaddr import Multiaddr

from peers.config import NetworkConfig
from swarm.relay import RelayPolicy, dial_addr, relay_peer

RELAY_ID = "QmQJ8QnNsJdRrw9YQ8NikgevHeXB1yCpvg7oKenzAHp8ic"
ED_ID = "12D3KooWKUXEpbqppZ8cG3qCCkJGPMmu8hb1z8ZiU2sbTbFvRNHX"
ME = "QmbTghmKayfByLZqY4eUqwERKtLM1tR5fJPj96J8GVTdhy"


@pytest.mark.parametrize("relay_id", [RELAY_ID, ED_ID], ids=["rsa", "ed25519"])
def test_a_relayed_address_carries_the_relays_bare_multihash(relay_id):
    relay = f"/ip4/10.77.0.1/tcp/41369/p2p/{relay_id}"
    encoded = dial_addr(f"{relay}/p2p-circuit/p2p/{ME}").to_bytes()
    digest = base58.b58decode(relay_id)
    head = Multiaddr("/ip4/10.77.0.1/tcp/41369").to_bytes()
    # /p2p (code 421 = varint a5 03), the multihash's length and bytes, then /p2p-circuit (code 290 = a2 02)
    assert encoded == head + b"\xa5\x03" + bytes([len(digest)]) + digest + b"\xa2\x02"
    # hivemind's own encoder writes the id as a CID (two more bytes, 01 72), which p2pd refuses
    assert Multiaddr(relay).to_bytes() != head + b"\xa5\x03" + bytes([len(digest)]) + digest


def test_a_plain_address_is_dialled_without_its_peer_id():
    assert dial_addr(f"/ip4/10.0.0.1/tcp/5/p2p/{ME}").to_bytes() == Multiaddr("/ip4/10.0.0.1/tcp/5").to_bytes()


@pytest.mark.parametrize("bad", ["/ip4/10.0.0.1/tcp/5/p2p-circuit/p2p/" + ME, "/p2p-circuit"])
def test_a_relayed_address_without_its_relay_is_refused(bad):
    with pytest.raises(ValueError, match="relay's peer id"):
        dial_addr(bad)


def test_a_private_peer_reserves_on_its_relays_and_announces_them():
    relay = f"/ip4/10.77.0.1/tcp/4001/p2p/{RELAY_ID}"
    policy = RelayPolicy(reachability="private", relays=(relay,))
    assert policy.reached == "relayed" and policy.dht_client
    assert policy.relayed_maddrs(ME) == (f"{relay}/p2p-circuit/p2p/{ME}",)
    # p2pd's own relay finder and relay service stay out of it (``peers.relay_slots``, ``peers.relay_service``)
    assert policy.p2pd_flags() == {"relayService": 0} and policy.hivemind_kwargs()["use_auto_relay"] is False
    assert relay_peer(relay) == RELAY_ID
    public = RelayPolicy(reachability="public", relays=(relay,))
    assert public.reached == "public" and not public.dht_client
    assert RelayPolicy().reached == "unmeasured"


def test_relays_default_to_the_initial_peers_of_a_private_peer():
    boot = f"/ip4/10.77.0.1/tcp/4001/p2p/{RELAY_ID}"
    other = f"/ip4/10.77.0.9/tcp/4001/p2p/{ME}"
    assert NetworkConfig(initial_peers=(boot,), reachability="private").relay_policy().relays == (boot,)
    chosen = NetworkConfig(initial_peers=(boot,), reachability="private", relay_via=(other,))
    assert chosen.relay_policy().relays == (other,)
    assert NetworkConfig(initial_peers=(boot,)).relay_policy().relays == ()  # auto: nothing reserved yet


@pytest.mark.parametrize("bad", ["/ip4/10.0.0.1/tcp/5", f"/ip4/1.2.3.4/tcp/5/p2p/{RELAY_ID}/p2p-circuit"])
def test_a_relay_must_be_a_full_address(bad):
    with pytest.raises(ValueError, match="full address"):
        RelayPolicy(reachability="private", relays=(bad,))
