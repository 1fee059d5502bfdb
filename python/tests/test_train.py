"""A small network built with the package's modules trains like the same network in PyTorch."""

import pytest

torch = pytest.importorskip("torch")

from kernels_torch import nn as knn  # noqa: E402

pytestmark = pytest.mark.gpu


def make_data(n=2048, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g) / d**0.5  # x @ w ~ N(0, 1): a smooth target
    y = torch.sin(x @ w) + 0.1 * (x[:, :1] ** 2) + 0.05 * torch.randn(n, 1, generator=g)
    return x.cuda(), y.cuda()


def net(swish):
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), swish(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1)
    ).cuda()


def train(model, x, y, steps=300, seed=1):
    torch.manual_seed(seed)  # the same dropout masks for both networks
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        i = torch.randint(0, x.shape[0], (256,), device=x.device)
        loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return losses, final


def test_linear_swish_dropout_linear_trains_like_pytorch():
    """Linear, Swish, Dropout, Linear; Adam, 300 steps, batches of 256 of 2048 generated points.

    Same initial weights (copied) and the same random batches and dropout masks (same seeds: the
    kernels draw no random numbers). The two runs differ only by the Swish's rounding (a few f32
    ulp per element), which training can amplify but not by much over 300 steps: the final
    full-data losses must agree within 1% (relative), and both must have fallen at least 4x.
    """
    x, y = make_data()
    torch.manual_seed(0)
    ref = net(torch.nn.SiLU)
    ours = net(knn.Swish)
    ours.load_state_dict(ref.state_dict())
    assert isinstance(ours[1], knn.Swish)
    ref_losses, ref_final = train(ref, x, y)
    our_losses, our_final = train(ours, x, y)
    print(f"loss: first {ref_losses[0]:.4f} / {our_losses[0]:.4f}, final {ref_final:.5f} / {our_final:.5f} (PyTorch / ours)")
    assert our_losses[0] == pytest.approx(ref_losses[0], rel=1e-5)
    assert ref_final < ref_losses[0] / 4 and our_final < our_losses[0] / 4
    assert our_final == pytest.approx(ref_final, rel=1e-2)
