"""When a version has reached the swarm (sparrowd.swarm.waits): pure, over snapshot node views."""

from sparrowd.swarm.waits import arrival


def node(i, versions=(), engine=None, state="up", role="rollout"):
    return {"node_id": i, "versions": list(versions), "engine_version": engine, "state": state, "role": role}


NODES = [node("trainer", [5], role="trainer"), node("a", [4, 5], engine=5), node("b", [4], engine=4),
         node("relay", [5], role="relay"), node("gone", [], state="stale")]


def test_every_live_node_but_the_trainer_counts():
    a = arrival(NODES, 5)
    assert not a.done and a.reached == ["a", "relay"] and a.missing == ["b"] and a.needed == 3
    assert arrival(NODES, 4).missing == ["relay"]
    assert arrival([n for n in NODES if n["node_id"] != "b"], 5).done


def test_engines_and_applied_count_the_nodes_with_an_engine():
    assert arrival(NODES, 5, engines=True).missing == ["b"]
    a = arrival(NODES, 4, applied=True)
    assert a.done and a.reached == ["a", "b"]  # an engine past the version has applied it
    assert arrival(NODES, 5, applied=True).missing == ["b"]


def test_named_nodes_and_a_fraction():
    assert arrival(NODES, 5, names=["a", "relay"]).done
    # A named node that is not live (stale, or unknown) is missing.
    assert arrival(NODES, 5, names=["a", "gone", "nobody"]).missing == ["gone", "nobody"]
    assert arrival(NODES, 5, fraction=0.6).done  # 2 of 3, ceil(1.8) = 2
    assert not arrival(NODES, 5, fraction=0.7).done  # ceil(2.1) = 3
    assert arrival([node("trainer", role="trainer")], 9).done  # nobody to wait for
