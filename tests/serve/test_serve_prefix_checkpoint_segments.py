"""``--checkpoint-every``'s split of mlx-lm's segments (no server): for any segments and any N, the pieces join back
into the prompt, a piece ends at every multiple of N inside the prompt and nowhere else but at a segment's own end,
``checkpoint`` pieces end exactly at those multiples (never at a segment's end), and each segment's last piece keeps
its type — so the server inserts at the same segment ends as mlx-lm and, in addition, at every multiple of N."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvshelf.mlx_lm.serve.prefix_checkpoints import PREFIX_CHECKPOINT, HeldPrefixCheckpoints, split_segments

segment = st.tuples(st.integers(1, 60), st.sampled_from(["system", "user", "assistant"]))


@given(st.lists(segment, min_size=1, max_size=4), st.integers(1, 40))
def test_split_segments_adds_exactly_the_multiples_of_every(shape, every) -> None:
    segments, types, pos = [], [], 0
    for n, kind in shape:
        segments.append(list(range(pos, pos + n)))
        types.append(kind)
        pos += n
    pieces, kinds = split_segments(segments, types, every)
    assert [t for p in pieces for t in p] == list(range(pos))
    assert all(pieces) and len(pieces) == len(kinds)
    ends, at = [], 0
    for p in pieces:
        at += len(p)
        ends.append(at)
    seg_ends = set()
    at = 0
    for n, _ in shape:
        at += n
        seg_ends.add(at)
    assert set(ends) == seg_ends | {k for k in range(every, pos, every)}
    for end, kind in zip(ends, kinds):
        if end in seg_ends:
            assert kind != PREFIX_CHECKPOINT
        else:
            assert kind == PREFIX_CHECKPOINT and end % every == 0
    assert [k for k in kinds if k != PREFIX_CHECKPOINT] == types


def test_held_checkpoints_go_to_the_first_insert_they_are_a_prefix_of() -> None:
    held = HeldPrefixCheckpoints(limit=2)
    held.hold([1, 2], [])
    held.hold([1, 2, 3, 4], [])
    held.hold([9, 9], [])  # the oldest ([1, 2]) is dropped: at most two held
    assert held.take_for([1, 2, 3], []) == {}
    assert held.take_for([1, 2, 3, 4, 5], []) == {4: []}
    assert held.take_for([1, 2, 3, 4, 5], []) == {} and len(held) == 1
