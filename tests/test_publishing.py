"""The trainer's chain rules, shared by ``Publisher`` and ``publish_checkpoint``."""

from __future__ import annotations

import pytest

from sparrowd.errors import InputError
from sparrowd.publishing import DEFAULT_ANCHOR_EVERY, anchor_due, check_anchor, check_follows


def test_a_patch_follows_the_last_version_and_an_anchor_is_not_older():
    check_follows(4, 3)
    with pytest.raises(InputError, match="version 3 does not follow the last published version 3"):
        check_follows(3, 3)
    check_anchor(3, 3)
    check_anchor(9, 3)
    with pytest.raises(InputError, match="anchor 2 is older than the last published version 3"):
        check_anchor(2, 3)


def test_an_anchor_is_due_every_so_many_versions_since_the_newest():
    assert not anchor_due(19, None, 20) and anchor_due(20, None, 20)
    assert not anchor_due(39, 20, 20) and anchor_due(41, 20, 20)
    assert not anchor_due(1000, None, 0)  # 0: never
    assert DEFAULT_ANCHOR_EVERY == 20
