"""The fleet's routing decision (trioshed.core.route), pure: states in, a node out."""

from __future__ import annotations

from trioshed.core.route import ModelLoad, NodeState, PrefixTable, choose, prefix_key

GB = 1024**3


def node(name: str, *, loaded: dict[str, ModelLoad] | None = None, room: int = 8 * GB, **kw: object) -> NodeState:
    fields: dict[str, object] = {"models": {"m": 2 * GB, "big": 20 * GB}, "loaded": loaded or {}, "room": room, "seen": 100.0}
    fields.update(kw)
    return NodeState(name, url=f"http://{name}", **fields)  # type: ignore[arg-type]


def pick(nodes: list[NodeState], model: str = "m", **kw: object) -> str:
    return choose(model, nodes, local="A", now=101.0, stale_after=5.0, **kw).node  # type: ignore[arg-type]


def test_warm_node_with_a_free_slot_serves_it() -> None:
    nodes = [node("A"), node("B", loaded={"m": ModelLoad(slots=2, busy=1)}), node("C")]
    choice = choose("m", nodes, local="A", now=101.0, stale_after=5.0)
    assert (choice.node, choice.reason) == ("B", "warm")
    assert choice.then[0] == "A"  # if B dies before answering: here first (no hop)


def test_the_lightest_warm_node_and_the_local_one_on_a_tie() -> None:
    busy, light = ModelLoad(slots=2, busy=1), ModelLoad(slots=2)
    assert pick([node("A", loaded={"m": busy}), node("B", loaded={"m": light})]) == "B"
    assert pick([node("A", loaded={"m": light}), node("B", loaded={"m": light})]) == "A"


def test_a_saturated_model_spreads_to_a_node_where_it_fits_without_evicting() -> None:
    full = ModelLoad(slots=1, busy=1, queued=3)
    assert pick([node("A", room=1 * GB), node("B", loaded={"m": full}), node("C")]) == "C"
    # nowhere it fits: the warm node with the shortest queue
    assert pick([node("A", room=0), node("B", loaded={"m": full}), node("C", room=0)]) == "B"


def test_requests_sent_since_the_last_state_count_so_a_burst_spreads() -> None:
    nodes = [node("A", room=0), node("B", loaded={"m": ModelLoad(slots=1)}), node("C")]
    assert pick(nodes) == "B"
    assert pick(nodes, pending={("B", "m"): 1}) == "B"  # its slot taken: a short queue there first
    # 2 GB load in 4 s: a queue waits for B until its last request would wait longer than that
    assert pick(nodes, pending={("B", "m"): 3}) == "B"
    assert pick(nodes, pending={("B", "m"): 4}) == "C"  # then a second copy where it fits
    # C now loads it (sent one): the next goes to the lighter of the two, not to a third node
    assert pick([*nodes, node("D")], pending={("B", "m"): 2, ("C", "m"): 1}) == "C"


def test_not_loaded_anywhere_goes_where_it_fits_local_first_else_the_same_node_whoever_decides() -> None:
    assert pick([node("A"), node("B")]) == "A"
    nodes = [node(name, room=GB if name in "AB" else 8 * GB) for name in "ABCDEFGH"]
    picks = {choose("m", nodes, local=name, now=101.0, stale_after=5.0).node for name in "AB"}
    assert len(picks) == 1 and picks <= set("CDEFGH")  # one copy, not one per deciding node
    # fits nowhere: the local policy (it evicts or queues)
    assert pick([node("A", room=GB), node("B", room=GB)], "big") == "A"
    # ... unless another node makes room by evicting only idle runners
    idle = {"m": ModelLoad(slots=1)}
    busy = {"m": ModelLoad(slots=1, busy=1)}
    assert pick([node("A", room=GB, loaded=busy), node("B", room=GB, loaded=idle, models={"m": 19 * GB, "big": 20 * GB})], "big") == "B"


def test_stale_draining_unreachable_and_storeless_nodes_get_nothing() -> None:
    warm = {"m": ModelLoad(slots=4)}
    assert pick([node("A"), node("B", loaded=warm, seen=90.0)]) == "A"  # 11 s old
    assert pick([node("A"), node("B", loaded=warm, draining=True)]) == "A"
    assert pick([node("A"), node("B", loaded=warm, reachable=False)]) == "A"
    assert pick([node("A"), node("B", loaded=warm, models={})]) == "A"
    # the local store lacks it: the node that has it
    assert pick([node("A", models={}), node("B", models={"m": GB}, room=0)]) == "B"
    assert pick([node("A", models={})]) == "A"  # nobody has it: here (a 404 here)


def test_a_conversation_goes_back_to_its_node_unless_overloaded() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    key = prefix_key(body)
    assert key is not None and key == prefix_key({**body, "messages": body["messages"] + [{"role": "assistant", "content": "x"}]})
    light, busy = ModelLoad(slots=2), ModelLoad(slots=2, busy=2, queued=1)
    nodes = [node("A", loaded={"m": light}), node("B", loaded={"m": ModelLoad(slots=2, busy=1)}, prefixes=frozenset({key}))]
    assert pick(nodes, prefix=key) == "B"
    assert pick(nodes, prefix="other") == "A"
    overloaded = [node("A", loaded={"m": light}), node("B", loaded={"m": ModelLoad(slots=1, busy=1, queued=1)}, prefixes=frozenset({key}))]
    assert pick(overloaded, prefix=key) == "A"
    assert pick([node("A", loaded={"m": light}), node("B", loaded={"m": busy})], prefix=key, routed="B") == "B"


def test_prefix_table_forgets_after_its_ttl_and_beyond_its_capacity() -> None:
    table = PrefixTable(capacity=2, ttl=10.0)
    table.note("p1", "B", 0.0)
    table.note("p2", "C", 1.0)
    assert table.owner("p1", 5.0) == "B"
    table.note("p3", "B", 2.0)  # p1 was used last but noted first: the oldest note goes
    assert table.owner("p1", 5.0) is None and table.owner("p3", 5.0) == "B"
    assert table.owner("p3", 13.0) is None
    assert table.held_by("C", 5.0) == frozenset({"p2"})
    assert prefix_key({"model": "m", "input": [1, 2]}) is None


def test_a_long_queue_spreads_by_evicting_only_idle_runners_where_nothing_fits() -> None:
    models = {"m": 4 * GB, "other": 4 * GB}
    idle_other = {"other": ModelLoad(slots=4)}
    full = [node("A", room=0, models=models, loaded={"other": ModelLoad(slots=4, busy=4)}),
            node("C", room=0, models=models, loaded=idle_other)]  # fmt: skip
    # a 4 GB load takes 6 s; evicting costs that twice (the evicted model's reload): 12 s
    queued = {"m": ModelLoad(slots=1, busy=1, queued=6)}  # 7 per slot, 12 s: not yet worth it
    assert pick([node("B", room=0, models=models, loaded=queued), *full]) == "B"
    longer = {"m": ModelLoad(slots=1, busy=1, queued=7)}  # 8 per slot, 14 s: C evicts its idle runner
    choice = choose("m", [node("B", room=0, models=models, loaded=longer), *full], local="A", now=101.0, stale_after=5.0)
    assert (choice.node, choice.reason) == ("C", "spread")


def test_a_copy_is_loaded_only_when_the_queue_waits_longer_than_the_load() -> None:
    models = {"m": 2 * GB, "big": 14 * GB}  # loads of 4 s and 16 s
    for model, queued, spreads in (("m", 2, False), ("m", 3, True), ("big", 8, False), ("big", 9, True)):
        warm = {model: ModelLoad(slots=1, busy=1, queued=queued)}
        nodes = [node("A", room=0, models=models), node("B", models=models, loaded=warm), node("C", room=16 * GB, models=models)]
        assert pick(nodes, model) == ("C" if spreads else "B"), (model, queued)
    # spread copies go to the same node whoever decides (one copy per burst, not one per node)
    warm = {"m": ModelLoad(slots=1, busy=1, queued=3)}
    nodes = [node("B", loaded=warm), *(node(name) for name in "ACDEFGH")]
    picks = {choose("m", nodes, local=name, now=101.0, stale_after=5.0).node for name in "ACDEFGH"}
    assert len(picks) == 1 and picks != {"B"}
