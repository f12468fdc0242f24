"""KnowGPTEmbedding: on a GPU in training its weight gradient is one matrix product of one-hot rows; it
must equal nn.Embedding's (sort and segmented sums) and fall back to nn.Embedding everywhere else."""

import pytest
import torch
import torch.nn.functional as F

from hf_knowgpt import KnowGPTConfig, KnowGPTForCausalLM
from hf_knowgpt.layers_knowgpt import KnowGPTEmbedding, _RowsWithMatrixProductGradient

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(37,), (4, 29)])
def test_matrix_product_gradient_equals_the_lookup_gradient(device, shape):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64).to(device).requires_grad_()
    ids = torch.randint(0, 11, shape, generator=generator).to(device)  # repeated ids: their rows sum
    grad = torch.randn(*shape, 8, generator=generator, dtype=torch.float64).to(device)
    rows = _RowsWithMatrixProductGradient.apply(weight, ids)
    (ours,) = torch.autograd.grad(rows, weight, grad)
    reference_rows = F.embedding(ids, weight)
    (reference,) = torch.autograd.grad(reference_rows, weight, grad)
    torch.testing.assert_close(rows, reference_rows, rtol=0, atol=0)
    torch.testing.assert_close(ours, reference)
    assert ours[torch.isin(torch.arange(11, device=device), ids, invert=True)].abs().sum() == 0


def test_cpu_training_and_evaluation_use_nn_embedding():
    embedding = KnowGPTEmbedding(11, 8)
    ids = torch.tensor([[1, 2, 2]])
    assert "Embedding" in type(embedding(ids).grad_fn).__name__
    with torch.no_grad():
        assert embedding(ids).grad_fn is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the matrix-product gradient runs on a GPU only")
def test_gpu_training_takes_the_matrix_product_and_the_same_gradient():
    torch.manual_seed(0)
    config = KnowGPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, block_size=24, attention_type="vanilla",
                           embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = KnowGPTForCausalLM(config).cuda().train()
    ids = torch.randint(0, 50, (3, 24), device="cuda")
    assert "RowsWithMatrixProductGradient" in type(model.transformer.tok_emb(ids).grad_fn).__name__
    model(input_ids=ids, labels=ids).loss.backward()
    ours = model.transformer.tok_emb.weight.grad.clone(), model.transformer.pos_emb.weight.grad.clone()
    model.zero_grad()
    for module in (model.transformer.tok_emb, model.transformer.pos_emb):
        module.__class__ = torch.nn.Embedding
    model(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(ours[0], model.transformer.tok_emb.weight.grad, rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(ours[1], model.transformer.pos_emb.weight.grad, rtol=2e-3, atol=1e-5)
