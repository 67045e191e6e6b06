"""Tests for pretrain/tokenizer.py: the EMA vector quantizer, the VQ-VAE tokenizer and its export."""

import copy
import json
import math

import pytest
import torch

from core.report.pictures import title_height
from pretrain.tokenizer import VQVAE, VectorQuantizerEMA, load_tokenizer, tokenizer_grid
from pretrain.train_tokenizer import export_tokenizer

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
PALETTE = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 0]])


@pytest.fixture(autouse=True)
def one_thread():
    # Two intra-op threads on two shared, busy cores make these tiny convolutions up to 30x slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def set_codebook(q: VectorQuantizerEMA, codebook: torch.Tensor) -> None:
    """Put the quantizer in its freshly-initialised state around `codebook` (counts 1, sums = codebook)."""
    q.codebook.copy_(codebook)
    q.ema_count.fill_(1.0)
    q.ema_sum.copy_(codebook)


def as_map(vectors: torch.Tensor) -> torch.Tensor:
    """(N, D) -> (1, D, 1, N), the quantizer's (B, D, h, w) layout."""
    return vectors.t()[None, :, None, :]


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.named_buffers()}


def test_codes_are_the_argmin_of_squared_distances():
    torch.manual_seed(0)
    q = VectorQuantizerEMA(16, 8)
    q.codebook.copy_(torch.randn(16, 8))
    z = torch.randn(2, 8, 3, 5)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8)  # (N, D)
    expected = ((flat[:, None, :] - q.codebook[None]) ** 2).sum(-1).argmin(dim=1).view(2, 3, 5)
    z_q, codes, stats = q.eval()(z)
    assert codes.dtype == torch.long
    assert torch.equal(codes, expected)
    assert torch.equal(q.quantize(z), expected)
    assert len(expected.unique()) > 8  # a real test of the argmin, not one code everywhere
    assert torch.equal(q.embed(codes), q.codebook[codes].permute(0, 3, 1, 2))
    torch.testing.assert_close(z_q, q.embed(codes))  # z + (z_q - z) rounds, hence close rather than equal
    torch.testing.assert_close(stats["commit_loss"], ((z - z_q) ** 2).mean())


def test_straight_through_gradient_is_identity():
    torch.manual_seed(0)
    q = VectorQuantizerEMA(8, 4)
    z = torch.randn(2, 4, 3, 3, requires_grad=True)
    z_q, _, _ = q(z)
    weights = torch.randn_like(z_q)
    (z_q * weights).sum().backward()
    assert torch.equal(z.grad, weights)
    z.grad = None
    z_q, _, stats = q(z)
    stats["commit_loss"].backward()  # d/dz mean((z - sg(z_q))^2) = 2 (z - z_q) / numel
    torch.testing.assert_close(z.grad, 2 * (z - z_q).detach() / z.numel())


def test_ema_update_by_hand():
    q = VectorQuantizerEMA(2, 2, decay=0.5, eps=0.0, dead_code_threshold=0.5)
    set_codebook(q, torch.tensor([[0.0, 0.0], [10.0, 10.0]]))
    z = as_map(torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, 10.0]]))
    _, codes, stats = q.train()(z)
    assert codes.flatten().tolist() == [0, 0, 1]
    # counts: 0.5 * 1 + 0.5 * [2, 1]; sums: 0.5 * [c0, c1] + 0.5 * [(1, 1), (9, 10)]
    torch.testing.assert_close(q.ema_count, torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(q.ema_sum, torch.tensor([[0.5, 0.5], [9.5, 10.0]]))
    torch.testing.assert_close(q.codebook, torch.tensor([[1 / 3, 1 / 3], [9.5, 10.0]]))
    assert q.num_updates.item() == 1
    p = torch.tensor([2 / 3, 1 / 3])
    torch.testing.assert_close(stats["perplexity"], torch.exp(-(p * p.log()).sum()))
    assert stats["codes_used"].item() == 1.0


def test_eval_mode_and_encode_do_not_change_buffers():
    torch.manual_seed(0)
    q = VectorQuantizerEMA(8, 4)
    before = buffers(q)
    q.eval()(torch.randn(2, 4, 3, 3))
    model = VQVAE(img_size=8, downsample=4, codebook_size=8, code_dim=4, hidden_dim=8).train()
    model_before = buffers(model)
    model.encode(torch.randn(2, 3, 8, 8))
    for name, value in before.items():
        assert torch.equal(dict(q.named_buffers())[name], value), name
    for name, value in model_before.items():
        assert torch.equal(dict(model.named_buffers())[name], value), name
    q.train()(torch.randn(2, 4, 3, 3))
    assert q.num_updates.item() == 1 and not torch.equal(q.codebook, before["codebook"])


def test_reduce_hook_equals_the_concatenated_global_batch():
    # Two ranks holding the same batch: the summed statistics are those of the batch seen twice, so the update
    # (EMA, restarts and their noise scale) must equal a single quantizer's on the concatenation.
    torch.manual_seed(0)
    z = torch.randn(4, 6, 3, 3) * 0.5 + 1.0  # shifted off the initial codebook: most codes unused, so restarts
    ranked, single = VectorQuantizerEMA(32, 6), VectorQuantizerEMA(32, 6)
    calls = []

    def fake_reduce(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return t.mul_(2)

    ranked.reduce = fake_reduce
    num_restarted = []
    for _ in range(3):
        _, _, stats_ranked = ranked(z)
        _, _, stats_single = single(torch.cat([z, z]))
        num_restarted.append((single.ema_count == 2.0).sum().item())  # a restarted code's count: 2 x threshold
    assert calls == [(32, 6 + 2)] * 3
    for name, value in single.named_buffers():
        torch.testing.assert_close(dict(ranked.named_buffers())[name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(stats_ranked["perplexity"], stats_single["perplexity"])
    assert stats_ranked["codes_used"].item() == stats_single["codes_used"].item()
    assert num_restarted[0] > 10  # the unused codes of the first batch were restarted
    ranked.eval()(z)
    assert len(calls) == 3  # evaluation never reduces (ranks may see different batches)


def _clusters() -> torch.Tensor:
    """(60, 2): 30, 20 and 10 points around (0, 0), (4, 0) and (0, 4)."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0]] * 30 + [[4.0, 0.0]] * 20 + [[0.0, 4.0]] * 10)
    return centres + 0.3 * torch.randn(60, 2, generator=gen)


def test_dead_code_restarts_next_to_the_most_used_code_deterministically():
    codebook = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [50.0, 50.0]])  # code 3 is never used
    z = as_map(_clusters())
    q, no_restarts = VectorQuantizerEMA(4, 2, decay=0.9), VectorQuantizerEMA(4, 2, decay=0.9, dead_code_threshold=0)
    for quantizer in (q, no_restarts):
        set_codebook(quantizer, codebook)
    twin, shifted = copy.deepcopy(q), copy.deepcopy(q)
    shifted.load_state_dict({**shifted.state_dict(), "num_updates": torch.tensor(7)})  # as a resume loads it
    for quantizer in (q, no_restarts, twin, shifted):
        quantizer(z)
    # Code 3's count decayed to 0.9 < 1; it copies code 0 (count 0.9 + 0.1 * 30) plus a little noise.
    assert torch.equal(q.codebook[:3], no_restarts.codebook[:3])
    torch.testing.assert_close(no_restarts.codebook[3], torch.tensor([50.0, 50.0]), atol=1e-3, rtol=0)  # eps only
    gap = (q.codebook[3] - q.codebook[0]).norm().item()
    assert 0 < gap < 0.2
    assert q.ema_count[3].item() == 2.0  # restarted at twice the threshold, statistics consistent
    torch.testing.assert_close(q.ema_sum[3], 2.0 * q.codebook[3])
    torch.testing.assert_close(q.ema_count[:3], no_restarts.ema_count[:3])
    # Same state and statistics -> the same restart (what keeps ranks in step); the counter seeds the noise.
    for name, value in q.named_buffers():
        assert torch.equal(dict(twin.named_buffers())[name], value), name
    assert not torch.equal(shifted.codebook[3], q.codebook[3])
    assert q._host_updates == 1 and shifted._host_updates == 8  # the seed's counter, read back once after the load
    # The restarted code splits code 0's cluster and stays in use.
    for _ in range(5):
        _, codes, stats = q(z)
    assert stats["codes_used"].item() == 1.0
    assert (codes == 3).sum().item() >= 5 and q.ema_count[3].item() > 1.0


def test_buffers_stay_fp32_under_bf16():
    torch.manual_seed(0)
    model = VQVAE(img_size=8, downsample=2, codebook_size=8, code_dim=4, hidden_dim=8).train()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = model({"image": torch.randn(2, 3, 8, 8)})
    assert out["loss"].dtype == torch.float32 and out["recon"].dtype == torch.float32
    assert model.quantizer.num_updates.item() == 1
    model.bfloat16()  # what DeepSpeed's bf16 mode does to the module
    assert model.encoder[0].weight.dtype == torch.bfloat16
    out = model({"image": torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)})
    assert out["loss"].dtype == torch.float32 and model.quantizer.num_updates.item() == 2
    assert model.decode_codes(model.encode(torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))).dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for k, v in model.quantizer.named_buffers() if k != "num_updates")
    assert model.quantizer.num_updates.dtype == torch.long
    model.float()
    assert model.encoder[0].weight.dtype == torch.float32 and model.quantizer.codebook.dtype == torch.float32


@pytest.mark.parametrize(("img_size", "downsample", "grid"), [(28, 4, (7, 7)), ((16, 32), 8, (2, 4))])
def test_vqvae_shapes(img_size, downsample, grid):
    torch.manual_seed(0)
    model = VQVAE(img_size=img_size, downsample=downsample, codebook_size=16, code_dim=8, hidden_dim=16)
    height, width = (img_size, img_size) if isinstance(img_size, int) else img_size
    images = torch.randn(2, 3, height, width)
    assert model.grid == grid
    out = model({"image": images})
    assert out["recon"].shape == images.shape and not out["recon"].requires_grad
    for key in ("loss", "recon_loss", "commit_loss", "perplexity", "codes_used"):
        assert out[key].shape == () and out[key].dtype == torch.float32, key
    torch.testing.assert_close(out["loss"], out["recon_loss"] + 0.25 * out["commit_loss"])
    codes = model.encode(images)
    assert codes.shape == (2, *grid) and codes.dtype == torch.long
    assert codes.min() >= 0 and codes.max() < 16
    assert model.decode_codes(codes).shape == images.shape
    assert json.loads(json.dumps(model.config))["img_size"] == [height, width]
    with pytest.raises(ValueError, match=rf"\(B, 3, {height}, {width}\).*\(2, 3, {height}, {height + 4}\)"):
        model({"image": torch.randn(2, 3, height, height + 4)})


@pytest.mark.parametrize(("img_size", "downsample"), [(16, 1), (16, 3), (24, 6), (30, 4), ((16, 20), 8)])
def test_bad_downsample_or_size_raises(img_size, downsample):
    with pytest.raises(ValueError, match="downsample"):
        VQVAE(img_size=img_size, downsample=downsample, codebook_size=8)


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = VQVAE(img_size=16, downsample=4, codebook_size=16, code_dim=8, hidden_dim=16).train()
    model({"image": torch.randn(4, 3, 16, 16)})["loss"].backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name
    assert not any(name.startswith("quantizer") for name, _ in model.named_parameters())  # EMA, not the optimizer


def coloured_shapes(num_images: int, gen: torch.Generator) -> torch.Tensor:
    """(num_images, 3, 16, 16) normalised pictures: a plain background and two squares, 8 colours."""
    colours = PALETTE.float()
    images = colours[torch.randint(0, 8, (num_images,), generator=gen)][:, :, None, None].repeat(1, 1, 16, 16)
    for image in images:
        for _ in range(2):
            side = int(torch.randint(4, 9, (1,), generator=gen))
            y, x = torch.randint(0, 16 - side + 1, (2,), generator=gen).tolist()
            image[:, y : y + side, x : x + side] = colours[int(torch.randint(0, 8, (1,), generator=gen))][:, None, None]
    return (images - 0.5) / 0.5


def test_tiny_training_lowers_recon_and_keeps_codes_in_use():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    pool = coloured_shapes(512, gen)
    model = VQVAE(img_size=16, downsample=4, codebook_size=32, code_dim=16, hidden_dim=64).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    recon, used = [], []
    for _ in range(150):
        out = model({"image": pool[torch.randint(0, 512, (32,), generator=gen)]})
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        recon.append(out["recon_loss"].item())
        used.append(out["codes_used"].item())
    initial, final = sum(recon[:5]) / 5, sum(recon[-10:]) / 10
    assert final < 0.5 * initial, (initial, final)
    assert min(used[-50:]) > 0.5, used[-50:]
    assert all(math.isfinite(r) for r in recon)


def test_export_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = VQVAE(img_size=(8, 16), downsample=4, codebook_size=16, code_dim=8, hidden_dim=16).train()
    for _ in range(3):  # move the EMA buffers off their initial values
        model({"image": torch.randn(4, 3, 8, 16)})
    out_dir = export_tokenizer(model, tmp_path / "tok", manifest={"step": 3, "kind": "overridden"})
    manifest = json.loads((out_dir / "mimpipe.json").read_text())
    assert manifest["kind"] == "vqvae" and manifest["step"] == 3
    assert manifest["vocab_size"] == 16 and manifest["grid"] == [2, 4] and manifest["tokenizer"] == model.config
    loaded = load_tokenizer(out_dir)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    images = torch.randn(4, 3, 8, 16)
    assert torch.equal(loaded.encode(images), model.encode(images))
    export_tokenizer(model, out_dir, manifest={})  # replacing an earlier export is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no temporary folders left behind


def test_load_rejects_other_kinds_and_missing_manifest(tmp_path):
    model = VQVAE(img_size=8, downsample=4, codebook_size=8, code_dim=4, hidden_dim=8)
    out_dir = export_tokenizer(model, tmp_path / "tok", manifest={})
    manifest_path = out_dir / "mimpipe.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "kind": "mae"}))
    with pytest.raises(ValueError, match=rf"{manifest_path}.*'mae'"):
        load_tokenizer(out_dir)
    with pytest.raises(ValueError, match=str(tmp_path / "empty" / "mimpipe.json")):
        load_tokenizer(tmp_path / "empty")


def test_tokenizer_grid_layout():
    torch.manual_seed(0)
    images, recon = torch.randn(10, 3, 8, 8), torch.randn(10, 3, 8, 8)
    grid = tokenizer_grid(images, recon, MEAN, STD, max_images=3)
    top = title_height()
    assert grid.shape == (3, top + 3 * 112 + 4 * 2, 2 * 112 + 3 * 2)  # 3 rows x 2 columns of 8 px x 14, 2 px padding
    assert grid.min() >= 0 and grid.max() <= 1
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    row1 = top + 2 + 114  # second row
    original = grid[:, row1 : row1 + 112 : 14, 2 : 2 + 112 : 14]  # left column, one pixel per 14 x 14 block
    recon_panel = grid[:, row1 : row1 + 112 : 14, 116 : 116 + 112 : 14]  # right column
    torch.testing.assert_close(original, (images[1] * std + mean).clamp(0, 1))
    torch.testing.assert_close(recon_panel, (recon[1] * std + mean).clamp(0, 1))
