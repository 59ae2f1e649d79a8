"""Random-LTD on a CUDA GPU: the wrapper's gather and scatter (torch, no custom op) give the
hand reference's output and gradients, the kept indices drawn on the GPU. Skipped without a
GPU."""

import pytest
import torch
from torch import nn

from shardwise.runtime.data_pipeline.data_routing import RandomLayerTokenDrop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BATCH, SEQ, WIDTH, KEPT = 4, 64, 32, 24


class Mixer(nn.Module):
    """Mixes tokens through the mask so a wrong gather of rows or columns shows."""

    def __init__(self, seq_first):
        super().__init__()
        self.seq_first = seq_first
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, attention_mask):
        x = x.transpose(0, 1) if self.seq_first else x
        x = x + (attention_mask[:, 0].softmax(-1) @ self.linear(x)).tanh()
        return x.transpose(0, 1) if self.seq_first else x


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_cuda_matches_hand_reference(order):
    torch.manual_seed(0)
    batch_first = order == "batch_seq_dim"
    layer = Mixer(seq_first=not batch_first).cuda()
    wrapper = RandomLayerTokenDrop(layer, mask_name="attention_mask", hidden_state_order=order)
    wrapper.kept_length = KEPT
    x = torch.randn(BATCH, SEQ, WIDTH, device="cuda")
    mask = torch.randn(BATCH, 1, SEQ, SEQ, device="cuda")
    hidden = (x if batch_first else x.transpose(0, 1)).detach().requires_grad_()
    out = wrapper(hidden, attention_mask=mask)
    idx = wrapper.last_kept_indices
    assert idx.is_cuda and bool((idx.diff(dim=1) > 0).all())
    out_x = out if batch_first else out.transpose(0, 1)
    out_x.square().sum().backward()
    got = [hidden.grad.clone(), layer.linear.weight.grad.clone()]

    layer.zero_grad()
    ref_hidden = x.detach().requires_grad_()
    merged = ref_hidden.clone()
    for b in range(BATCH):
        keep = idx[b]
        part = ref_hidden[b, keep][None] if batch_first else ref_hidden[b, keep][:, None]
        part = layer(part, attention_mask=mask[b : b + 1][:, :, keep][:, :, :, keep])
        merged[b, keep] = part[0] if batch_first else part[:, 0]
    merged.square().sum().backward()
    expected_hidden = ref_hidden.grad if batch_first else ref_hidden.grad.transpose(0, 1)
    torch.testing.assert_close(out_x, merged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], expected_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], layer.linear.weight.grad, rtol=1e-4, atol=1e-4)
