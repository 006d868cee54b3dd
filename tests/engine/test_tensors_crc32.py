"""`tensors_crc32`: what the ranks of a TP group compare before a forward ([Note: a
TP group reads the same rows] in offload/engine/rank_order.py)."""

import torch

from offload.engine.rank_order import tensors_crc32


def test_the_same_tensors_give_the_same_fingerprint_and_any_change_another():
    ids = torch.arange(24).reshape(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    one = tensors_crc32((), {"input_ids": ids, "attention_mask": mask})
    assert one == tensors_crc32((), {"attention_mask": mask.clone(), "input_ids": ids.clone()})
    changed = ids.clone()
    changed[3, 5] += 1
    others = [
        tensors_crc32((), {"input_ids": changed, "attention_mask": mask}),  # a keyword's
        tensors_crc32((), {"input_ids": ids.flip(0), "attention_mask": mask}),  # order
        tensors_crc32((), {"input_ids": ids.reshape(6, 4), "attention_mask": mask}),  # shape
        tensors_crc32((), {"input_ids": ids.to(torch.int32), "attention_mask": mask}),
        tensors_crc32((ids,), {"attention_mask": mask}),  # another place
    ]
    assert one not in others and len(set(others)) == len(others)


def test_tensors_inside_tuples_lists_and_dicts_of_any_dtype_and_layout_count():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    t = x.t()  # not contiguous: its elements in the order of its shape
    base = tensors_crc32(([x, {"k": t}],), {})
    assert base == tensors_crc32(([x.clone(), {"k": t.contiguous()}],), {})
    y = t.clone()
    y[0, 0] = 7
    assert base != tensors_crc32(([x, {"k": y}],), {})
    assert tensors_crc32((torch.empty(0), 3, None), {}) == \
        tensors_crc32((torch.empty(0), 4, "a"), {})  # only tensors count
    assert tensors_crc32((torch.empty(2, 0),), {}) != tensors_crc32((torch.empty(0),), {})
