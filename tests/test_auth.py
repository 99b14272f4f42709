"""The daemon's tokens (``sparrowd.daemon.auth.Tokens``), built from the token file alone: the first
line is presented, every shared token is accepted, a credential line admits only this node's own
local commands and engines."""

from __future__ import annotations

from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from sparrowd.daemon.auth import Tokens
from sparrowd.errors import InputError


def _request(peer: str):
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: (peer, 1234) if key == "peername" else default
    return make_mocked_request("POST", "/v1/node/leave", transport=transport)


def test_every_shared_token_is_accepted_and_the_first_presented(tmp_path):
    f = tmp_path / "swarm.token"
    f.write_text("a" * 48 + "\n" + "b" * 48 + "\n")
    f.chmod(0o600)
    t = Tokens(f)
    t.load()
    assert t.token == "a" * 48 and t.accepted() == 2
    assert t.ok("Bearer " + "a" * 48) and t.ok("Bearer " + "b" * 48) and not t.ok("Bearer " + "c" * 48)
    assert t.local_ok("b" * 48) and not t.local_ok("c" * 48)
    assert not t.own(_request("127.0.0.1"), "Bearer " + "a" * 48)  # a shared token is no credential


def test_a_credential_line_admits_only_this_nodes_own_local_requests(tmp_path):
    cred = "spw1." + "x" * 60
    f = tmp_path / "swarm.token"
    f.write_text(cred + "\n")
    f.chmod(0o600)
    t = Tokens(f)
    t.load()
    assert t.token == cred and t.accepted() == 1 and not t.ok("Bearer " + cred)
    assert t.own(_request("127.0.0.1"), "Bearer " + cred) and not t.own(_request("10.0.0.5"), "Bearer " + cred)
    assert t.local_ok(cred)


def test_a_bad_token_file_keeps_the_tokens_in_use(tmp_path):
    f = tmp_path / "swarm.token"
    f.write_text("a" * 48 + "\n")
    f.chmod(0o600)
    t = Tokens(f)
    t.load()
    f.write_text("short\n")
    with pytest.raises(InputError):
        t.load()
    assert t.token == "a" * 48 and t.ok("Bearer " + "a" * 48)
