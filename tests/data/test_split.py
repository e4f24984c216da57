from data.split import base_id, is_eval, split_indices


def test_base_id():
    assert base_id("abc_1") == "abc" and base_id("abc") == "abc" and base_id("abc_0_12") == "abc"
    assert base_id("a_b_3") == "a_b" and base_id("123") == "123" and base_id("_1") == "_1"


def test_pieces_of_one_conversation_share_a_side():
    ids = [f"conv{i}_{j}" for i in range(500) for j in range(3)]
    train, held_out = split_indices(ids, eval_fraction=0.2, seed=0)
    train_bases = {base_id(ids[i]) for i in train}
    eval_bases = {base_id(ids[i]) for i in held_out}
    assert not train_bases & eval_bases
    assert 60 <= len(eval_bases) <= 140  # ~100 of 500 conversations
    assert sorted(train + held_out) == list(range(len(ids)))


def test_split_is_deterministic_order_free_and_seeded():
    ids = [f"x{i}" for i in range(300)]
    first = {ids[i] for i in split_indices(ids, 0.3, seed=1)[1]}
    again = {list(reversed(ids))[i] for i in split_indices(list(reversed(ids)), 0.3, seed=1)[1]}
    other = {ids[i] for i in split_indices(ids, 0.3, seed=2)[1]}
    assert first == again and first != other
    assert is_eval("abc_0", 0.5, 3) == is_eval("abc_7", 0.5, 3) == is_eval("abc", 0.5, 3)
