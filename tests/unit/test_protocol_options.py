"""Per-protocol options are declared by the protocol's spec (`ProtocolSpec.options`): the
server hands protocols only settings some spec declares, and each reads its own typed."""

from __future__ import annotations

import dataclasses

import protocols
from protocols.djl.options import DjlOptions
from protocols.tgi.routes import TgiOptions
from server.gateway import protocol_options
from server.http.context import ProtocolContext, options_of
from tests.unit.gateway_kit import make_gateway


def test_every_option_the_server_hands_protocols_is_declared_by_a_spec() -> None:
    gateway = make_gateway()
    declared = {
        f.name for spec in protocols.REGISTRY if spec.options
        for f in dataclasses.fields(spec.options)
    }
    assert set(protocol_options(gateway.settings)) == declared


def test_each_protocol_reads_its_options_typed_with_defaults_for_what_is_absent() -> None:
    gateway = make_gateway(overrides={"ProtocolConfig": {"rollingBatch": "lmi-dist",
                                                         "tgiCompat": True}})
    ctx = gateway.context
    assert options_of(DjlOptions, ctx).legacy_rolling_batch
    assert options_of(TgiOptions, ctx).tgi_compat
    bare = ProtocolContext(service=gateway.service)
    assert not options_of(DjlOptions, bare).legacy_rolling_batch
    assert options_of(DjlOptions, bare).workflows == ()
