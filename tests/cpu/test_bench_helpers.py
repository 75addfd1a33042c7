"""The benchmark helpers that decide what is timed and in which order (no GPU needed)."""

import os

import pytest

import distgemm
from distgemm.bench.common import parse_variants, shuffled, with_settings


def test_parse_variants_reads_names_and_settings():
    spec = "p2:DISTGEMM_TP_PIECES=2; p3t:tp_pieces=3t,DISTGEMM_TP_ALGO=decomposed;"
    assert parse_variants(spec) == {
        "p2": {"tp_pieces": "2"},
        "p3t": {"tp_pieces": "3t", "tp_algo": "decomposed"},
    }
    assert parse_variants("") == {}


@pytest.mark.parametrize("spec", ["p2", "p2:", ":DISTGEMM_TP_PIECES=2", "p2:DISTGEMM_TP_PIECES"])
def test_parse_variants_refuses_malformed_specs(spec):
    with pytest.raises(ValueError, match="variant"):
        parse_variants(spec)


@pytest.mark.parametrize("spec, match", [("p:DISTGEMM_TP_WHAT=2", "DISTGEMM_TP_WHAT.* is not a distgemm setting"),
                                         ("p:tp_what=2", "unknown setting 'tp_what'"),
                                         ("p:tp_pieces=9", "tp_pieces must be")])
def test_parse_variants_names_a_bad_setting_before_anything_runs(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_variants(spec)


def test_shuffled_order_is_the_same_on_every_rank_and_changes_between_rounds():
    names = [f"impl{i}" for i in range(8)]
    orders = [shuffled(names, turn) for turn in range(5)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [shuffled(names, turn) for turn in range(5)]  # what another rank computes
    assert len({tuple(o) for o in orders}) > 1
    # no column keeps the same predecessor in every round (the bias the rotating order had)
    for name in names:
        before = {o[o.index(name) - 1] if o.index(name) else None for o in orders}
        assert len(before) > 1


def test_with_settings_restores_the_previous_settings():
    before = distgemm.current_settings()
    seen = with_settings({"grouped_backend": "torch", "tp_pieces": 2},
                         lambda: (distgemm.current_settings().grouped_backend, distgemm.current_settings().tp_pieces))
    assert seen() == ("torch", "2")
    assert distgemm.current_settings() is before
    assert seen() == ("torch", "2")  # each call under the overrides


# ---------------------------------------------------------------- FP8 grouped suite helpers


@pytest.fixture(scope="module")
def fp8s():
    """The FP8 grouped suite module, imported here so that a stale install fails these tests
    only (its helpers are pure PyTorch and run on the CPU)."""
    from distgemm.bench import grouped_fp8_suite

    return grouped_fp8_suite


def _meta(t):
    import torch

    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def test_fp8_suite_shapes(fp8s):
    full = fp8s.configs(False)
    assert {(c["n"], c["k"]) for c in full} == {(4096, 7168), (7168, 2048)}
    assert {(c["groups"], c["mean"]) for c in full} == {(4, 8192), (8, 4096), (32, 1024), (64, 512)}
    assert len(full) == 8 and all(c["routings"] == ("balanced", "zipf") for c in full)
    assert all(c["n"] % 128 == 0 and c["k"] % 128 == 0 for c in full)
    quick = fp8s.configs(True)
    assert len(quick) == 2 and any("zipf" in c["routings"] for c in quick)
    for configs in (full, quick):  # every figure of the summary has its row
        have = {(c["groups"], c["mean"], c["n"], c["k"]) for c in configs if "balanced" in c["routings"]}
        assert all(key[1:] in have for key in fp8s.SUMMARY_TFLOPS.values())


def test_fp8_suite_summary_keys_are_the_documented_ones(fp8s):
    assert set(fp8s.SUMMARY_KEYS) == {
        "forward_block_vs_cublas_block_loop", "forward_row_vs_torch_scaled_grouped_mm",
        "forward_row_vs_torch_scaled_grouped_mm_fast", "forward_block_vs_ours_bf16",
        "dgrad_block_vs_cublas_block_loop", "dgrad_block_e5m2_vs_ours_e4m3", "wgrad_block_vs_ours_bf16_wgrad",
        "skewed_vs_balanced_forward_block", "tflops_forward_block_8x4096_n4096_k7168",
        "tflops_forward_block_8x4096_n7168_k2048", "tflops_wgrad_block_8x4096_n4096_k7168"}


@pytest.mark.parametrize("counts", [[128, 128], [300, 0, 5, 1000], [1, 1, 1], [0, 0, 257], "zipf"])
def test_fp8_padded_layout(fp8s, counts):
    from distgemm.bench.grouped_suite import counts_for

    counts = counts_for(32, 1024, "zipf") if counts == "zipf" else counts
    tokens, groups = sum(counts), len(counts)
    tp = fp8s.padded_tokens(tokens, groups)
    assert tp == 128 * (-(-tokens // 128) + groups)
    starts = fp8s.padded_starts(counts)
    ends = [0] + list(__import__("itertools").accumulate(counts))
    assert starts == [128 * (g + ends[g] // 128) for g in range(groups)]
    assert all(s % 128 == 0 for s in starts)
    index = fp8s.padded_token_index(counts)
    assert len(index) == tokens and index == sorted(set(index)) and (not index or index[-1] < tp)
    # no block of 128 columns holds tokens of two experts
    owner = {}
    for g, (s, c) in enumerate(zip(starts, counts)):
        for col in range(s, s + c):
            assert owner.setdefault(col // 128, g) == g


def test_fp8_padded_layout_matches_the_library(fp8s):
    grouped_fp8 = pytest.importorskip("distgemm.grouped_fp8")
    import torch

    counts = [300, 0, 5, 1000, 128]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    assert grouped_fp8.padded_columns(offs, sum(counts)) == list(zip(fp8s.padded_starts(counts), counts))


def test_fp8_quant_1x128_layout_and_round_trip(fp8s):
    import torch

    x = torch.randn(300, 384).to(torch.bfloat16)
    data, scale = fp8s.quant_1x128(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (300, 384)
    assert scale.shape == (300, 3) and scale.stride() == (1, 300)  # T-major, as cuBLAS reads it
    amax = x.float().view(300, 3, 128).abs().amax(-1)
    assert torch.allclose(scale, amax / 448.0)
    assert fp8s.max_rel_err(fp8s.dequant_1x128(data, scale), x) < fp8s.QUANT_TOLERANCE


def test_fp8_quant_transposed_padded_keeps_experts_apart(fp8s):
    import torch

    counts = [200, 0, 37, 300]
    x = torch.cat([torch.randn(c, 256) * 10.0 ** g for g, c in enumerate(counts)]).to(torch.bfloat16)
    tp = fp8s.padded_tokens(x.shape[0], len(counts))
    index = torch.tensor(fp8s.padded_token_index(counts))
    data, scale = fp8s.quant_1x128_t_padded(x, index, tp)
    assert data.shape == (256, tp) and data.is_contiguous()
    assert scale.shape == (256, tp // 128) and scale.stride() == (1, 256)
    pad = torch.ones(tp, dtype=torch.bool)
    pad[index] = False
    assert (data.float()[:, pad] == 0).all()
    back = fp8s.unpad_dequant(data, scale, index, dtype=torch.float32)
    assert back.shape == x.shape
    start = 0
    for c in counts:  # each expert exact to FP8 precision, whatever its neighbours' magnitude
        if c:
            assert fp8s.max_rel_err(back[start:start + c], x[start:start + c]) < fp8s.QUANT_TOLERANCE
        start += c


def test_fp8_plain_quantizers_match_the_library_reference(fp8s):
    """The plain-PyTorch quantizers (the GB/s peer, and the wgrad inputs where
    distgemm.quantize_fp8 is missing) give the library's data and scales, in its layouts."""
    quantize = pytest.importorskip("distgemm.quantize")
    import torch

    counts = [200, 0, 37, 300]
    x = torch.randn(sum(counts), 384).to(torch.bfloat16)
    data, scale = fp8s.quant_1x128(x)
    ref_data, ref_scale = quantize.reference_quantize_fp8(x, (1, 128))
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scale, ref_scale) and scale.stride() == ref_scale.stride()
    offs = fp8s.offsets(counts, "cpu")
    tp = fp8s.padded_tokens(x.shape[0], len(counts))
    data, scale = fp8s.quant_1x128_t_padded(x, torch.tensor(fp8s.padded_token_index(counts)), tp)
    ref_data, ref_scale = quantize.reference_quantize_fp8(x, (1, 128), transpose=True, offs=offs)
    assert data.shape == ref_data.shape and scale.shape == ref_scale.shape and scale.stride() == ref_scale.stride()
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    used = torch.zeros(tp // 128, dtype=torch.bool)  # blocks without tokens: any scale (data 0)
    for start, c in zip(fp8s.padded_starts(counts), counts):
        used[start // 128:(start + c + 127) // 128] = c > 0
    assert torch.equal(scale[:, used], ref_scale[:, used])


def test_fp8_quant_128x128_and_rows(fp8s):
    import torch

    w = torch.randn(3, 256, 384).to(torch.bfloat16)
    data, scale = fp8s.quant_128x128(w)
    assert data.shape == w.shape and scale.shape == (3, 2, 3) and scale.is_contiguous()
    assert fp8s.max_rel_err(fp8s.dequant_128x128(data, scale), w) < fp8s.QUANT_TOLERANCE
    data, scale = fp8s.quant_rows(w)
    assert scale.shape == (3, 256)
    assert fp8s.max_rel_err(data.float() * scale.unsqueeze(-1), w) < fp8s.QUANT_TOLERANCE
    x = torch.randn(50, 384).to(torch.bfloat16)
    data, scale = fp8s.quant_rows(x)
    assert scale.shape == (50,) and fp8s.max_rel_err(data.float() * scale[:, None], x) < fp8s.QUANT_TOLERANCE


def _emulated_block_mm(a, b, sa, sb):
    """What cuBLAS computes from F.scaled_mm's BlockWise1x128 x BlockWise128x128 operands:
    a (M, K) with sa[m, kb], b (K, N) with sb[kb, nb] (K blocks padded to a multiple of 4)."""
    m, k = a.shape
    n, kb = b.shape[1], -(-a.shape[1] // 128)
    a_deq = a.float() * sa.repeat_interleave(128, 1)[:, :k]
    b_deq = b.float() * sb[:kb].repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
    return a_deq @ b_deq


@pytest.mark.parametrize("n,k", [(256, 384), (384, 1024)])
def test_fp8_cublas_loop_operands_pass_torch_checks_and_compute_the_grouped_gemm(fp8s, n, k):
    """The per-expert F.scaled_mm operands (forward and dgrad) satisfy torch 2.11's checks
    (run on meta tensors), and the block scales land where cuBLAS reads them."""
    import torch
    import torch.nn.functional as F
    from torch.nn.functional import ScalingType

    counts = [77, 0, 130, 1]
    x8, sx = fp8s.quant_1x128(torch.randn(sum(counts), k).to(torch.bfloat16))
    dy8, sdy = fp8s.quant_1x128(torch.randn(sum(counts), n).to(torch.bfloat16))
    w8, sw = fp8s.quant_128x128(torch.randn(len(counts), n, k).to(torch.bfloat16))
    wt8 = w8.transpose(1, 2).contiguous()
    w_deq = fp8s.dequant_128x128(w8, sw, dtype=torch.float32)
    cases = {  # (a, its scales, b_kn, scales of b as (N/128, K/128) blocks, reference of expert e)
        "forward": (x8, sx, lambda e: w8[e].t(), lambda e: sw[e],
                    lambda e, rows: fp8s.dequant_1x128(x8[rows], sx[rows]) @ w_deq[e].T),
        "dgrad": (dy8, sdy, lambda e: wt8[e].t(), lambda e: sw[e].t(),
                  lambda e, rows: fp8s.dequant_1x128(dy8[rows], sdy[rows]) @ w_deq[e]),
    }
    for name, (a, sa, b_kn, sb_nk, ref) in cases.items():
        seen = []

        def api(pa, pb, psa, psb):
            F.scaled_mm(_meta(pa), _meta(pb), _meta(psa), ScalingType.BlockWise1x128, _meta(psb),
                        ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
            seen.append(pa.shape[0])
            return _emulated_block_mm(pa, pb, psa, psb)
        outs = fp8s.cublas_block_loop(a, b_kn, sa, sb_nk, counts)(api)
        assert seen == [c for c in counts if c], name  # empty experts skipped
        live = [(e, slice(s, f)) for e, (s, f) in enumerate(fp8s.group_bounds(counts)) if f > s]
        for out, (e, rows) in zip(outs, live):
            assert fp8s.max_rel_err(out, ref(e, rows)) < 1e-5, name


def test_fp8_row_wise_peer_operands_pass_torch_checks(fp8s):
    import torch

    counts = [100, 0, 28]
    xr8, sxr = fp8s.quant_rows(torch.randn(sum(counts), 256).to(torch.bfloat16))
    wr8, swr = fp8s.quant_rows(torch.randn(3, 384, 256).to(torch.bfloat16))
    offs = fp8s.offsets(counts, "cpu")
    assert offs.dtype == torch.int32 and offs.tolist() == [100, 100, 128]
    for fast in (False, True):
        out = torch._scaled_grouped_mm(_meta(xr8), _meta(wr8.transpose(-2, -1)), scale_a=_meta(sxr),
                                       scale_b=_meta(swr), offs=_meta(offs), out_dtype=torch.bfloat16,
                                       use_fast_accum=fast)
        assert out.shape == (128, 384)


def test_fp8_max_rel_err(fp8s):
    import torch

    ref = torch.randn(64, 33)
    ours = ref.clone()
    ours[5, 7] += 0.5
    expected = 0.5 / ref.abs().max().item()
    assert fp8s.max_rel_err(ours, ref) == pytest.approx(expected, rel=1e-5)
    assert fp8s.max_rel_err(ours, ref, chunk=40) == pytest.approx(expected, rel=1e-5)  # chunked
    ours[0, 0] = float("nan")
    assert fp8s.max_rel_err(ours, ref) != fp8s.max_rel_err(ours, ref)  # nan
    with pytest.raises(ValueError):
        fp8s.max_rel_err(ref[:3], ref)


def test_fp8_summary(fp8s):
    def row(op, g, mean, n, k, routing, ours_ms, **peers):
        r = {"shape": {"op": op, "groups": g, "tokens_per_group": mean, "n": n, "k": k, "routing": routing},
             "distgemm": {"ms": ours_ms, "tflops": round(2.0 * g * mean * n * k / ours_ms / 1e9, 2)}}
        r["ratios"] = {p: ms / ours_ms for p, ms in peers.items()}
        return r

    rows = [row("forward_block", 8, 4096, 4096, 7168, "balanced", 1.0, cublas_block_loop=2.0, ours_bf16=1.5),
            row("forward_block", 8, 4096, 4096, 7168, "zipf", 1.2, cublas_block_loop=1.2 * 8.0),
            row("forward_block", 8, 4096, 7168, 2048, "balanced", 0.5),
            row("wgrad_block", 8, 4096, 4096, 7168, "balanced", 2.0, ours_bf16_wgrad=3.0),
            row("forward_row", 8, 4096, 4096, 7168, "balanced", 1.0, torch_scaled_grouped_mm=1.1)]
    summary = fp8s.summarize(rows)
    assert set(summary) == set(fp8s.SUMMARY_KEYS)
    assert summary["forward_block_vs_cublas_block_loop"] == pytest.approx(4.0)  # geomean of 2 and 8
    assert summary["forward_block_vs_ours_bf16"] == pytest.approx(1.5)
    assert summary["wgrad_block_vs_ours_bf16_wgrad"] == pytest.approx(1.5)
    assert summary["forward_row_vs_torch_scaled_grouped_mm"] == pytest.approx(1.1)
    assert summary["forward_row_vs_torch_scaled_grouped_mm_fast"] is None
    assert summary["dgrad_block_vs_cublas_block_loop"] is None
    assert summary["skewed_vs_balanced_forward_block"] == pytest.approx(1.2)
    assert summary["tflops_forward_block_8x4096_n4096_k7168"] == rows[0]["distgemm"]["tflops"]
    assert summary["tflops_forward_block_8x4096_n7168_k2048"] == rows[2]["distgemm"]["tflops"]
    assert summary["tflops_wgrad_block_8x4096_n4096_k7168"] == rows[3]["distgemm"]["tflops"]


# ---------------------------------------------------------------- sweep suite helpers


def _source_module(name):
    """distgemm/bench/<name>.py of this source tree, imported without the compiled library
    (as a module of a stand-in package, so that its relative imports resolve to the source's
    bench modules): the sweep's helpers are pure Python, and the installed distgemm may be
    older than the tree (then it has no sweep_suite)."""
    import importlib
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    bench = os.path.join(here, "..", "..", "python", "distgemm", "bench")
    package = "_distgemm_bench_source"
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, os.path.join(bench, "__init__.py"),
                                                      submodule_search_locations=[bench])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")


@pytest.fixture(scope="module")
def sweep():
    return _source_module("sweep_suite")


@pytest.fixture(scope="module")
def bench_main():
    return _source_module("__main__")


def test_sweep_parse_shapes_reads_lists_and_files(sweep, tmp_path):
    assert sweep.parse_shapes("4096x2112x7168,128x4096x4096") == [(4096, 2112, 7168), (128, 4096, 4096)]
    assert sweep.parse_shapes(" 1X4096x4096 , 1x4096x4096,7x64x2880 ") == [(1, 4096, 4096), (7, 64, 2880)]
    path = tmp_path / "shapes.txt"
    path.write_text("# M x N x K\n4096x2112x7168\n\n  128x4096x4096   # decode\n# 5x5x5\n"
                    "3x8x16, 5x8x16\n4096x2112x7168\n")
    assert sweep.parse_shapes(f"@{path}") == [(4096, 2112, 7168), (128, 4096, 4096), (3, 8, 16), (5, 8, 16)]
    assert sweep.parse_shapes("8x1024x4096x7168,32x256x2048x7168", 4, "--grouped-shapes") == [
        (8, 1024, 4096, 7168), (32, 256, 2048, 7168)]


@pytest.mark.parametrize("spec", ["", "  ", "4096x2112", "4096x2112x7168x1", "0x4096x4096", "-1x4096x4096",
                                  "1.5x4096x4096", "axbxc", "4096x2112x7168,", "4096x2112x7168,,1x2x3",
                                  "4096 2112 7168", "4096x2112x", "@/nonexistent/shapes.txt"])
def test_sweep_parse_shapes_refuses_malformed_specs(sweep, spec):
    with pytest.raises(ValueError, match="--shapes") as info:
        sweep.parse_shapes(spec)
    assert "MxNxK" in str(info.value) or "cannot read" in str(info.value)


def test_sweep_parse_shapes_refuses_bad_files_and_grouped_specs(sweep, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="no shapes"):
        sweep.parse_shapes(f"@{path}")
    path.write_text("4096x2112x7168\n4096x2112\n")
    with pytest.raises(ValueError, match=r"empty.txt:2 '4096x2112' is not MxNxK"):
        sweep.parse_shapes(f"@{path}")
    with pytest.raises(ValueError, match="--grouped-shapes.*GxPERxNxK"):
        sweep.parse_shapes("8x1024x4096", 4, "--grouped-shapes")


def test_bench_cli_shapes_options(bench_main, capsys):
    args = bench_main.parse_args(["--shapes", "4096x2112x7168,128x4096x4096"])
    assert args.suites == ["sweep"] and args.grouped_shapes is None
    assert args.shapes == [(4096, 2112, 7168), (128, 4096, 4096)]
    args = bench_main.parse_args(["--grouped-shapes", "8x1024x4096x7168"])
    assert args.suites == ["sweep"] and args.shapes is None and args.grouped_shapes == [(8, 1024, 4096, 7168)]
    assert bench_main.parse_args(["--suites", "gemm", "--shapes", "1x8x8"]).suites == ["gemm", "sweep"]
    assert bench_main.parse_args([]).suites == list(bench_main.SUITES) and "sweep" in bench_main.SUITES
    assert bench_main.parse_args(["--suites", "sweep", "--quick"]).shapes is None
    for argv, expected in ((["--shapes", "4096x7"], "'4096x7' is not MxNxK"),
                           (["--grouped-shapes", "8x4096x7168"], "is not GxPERxNxK"),
                           (["--suites", "gemm,nope"], "unknown suites")):
        with pytest.raises(SystemExit) as info:
            bench_main.parse_args(argv)
        assert info.value.code == 2
        assert expected in capsys.readouterr().err
    assert "--shapes" in bench_main.build_parser().format_help()
    assert "--grouped-shapes" in bench_main.__doc__


def test_sweep_dense_rows(sweep):
    full, quick = sweep.dense_rows(), sweep.dense_rows(quick=True)
    assert 120 <= len(full) <= 160 and 15 <= len(quick) <= 25
    for rows in (full, quick):
        keys = [(r["m"], r["n"], r["k"]) for r in rows]
        assert len(set(keys)) == len(keys)  # no duplicates
        assert all(1 <= m <= sweep.M_MAX and n % 8 == 0 and k % 8 == 0 for m, n, k in keys)
        assert all(2.0 * m * n * k <= sweep.DENSE_FLOP_CAP for m, n, k in keys)
        assert set(sweep.NAMED_M) <= {m for m, _, _ in keys}
        assert keys != sorted(keys)  # shuffled
    assert full == sweep.dense_rows() and quick == sweep.dense_rows(quick=True)  # fixed seed
    ms = [r["m"] for r in full]
    assert sum(m % 2 for m in ms) >= 20  # odd M
    assert sum(m <= 256 for m in ms) >= 30 and sum(m >= 2048 for m in ms) >= 30
    layers = {r["layer"].split("/")[0].split(".")[0] for r in full}
    assert layers >= {"llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3", "qwen3-8b", "qwen3-32b",
                      "qwen3-235b-a22b", "qwen3-30b-a3b", "gpt-oss-120b"}
    assert {r["layer"].split("/tp")[1] for r in full} == {"1", "2", "4", "8"}
    # every unsharded layer shape is in the full sweep
    assert {(c["n"], c["k"]) for c in sweep.catalogue() if c["tp"] == 1} <= {(r["n"], r["k"]) for r in full}
    # about two minutes on an H200 (rough model), a few seconds quick
    assert sweep.estimate_seconds(full, sweep.grouped_rows()) < 150
    assert sweep.estimate_seconds(quick, sweep.grouped_rows(quick=True)) < 30


def test_sweep_model_shapes_and_tp_shards(sweep):
    layers = sweep.model_layers()
    by_key = {}
    for model, layer, n, k, tp in layers:
        assert (model, layer, tp) not in by_key
        by_key[(model, layer, tp)] = (n, k)
    nk = {(c["n"], c["k"]) for c in sweep.catalogue()}
    assert len(nk) == len(sweep.catalogue())
    assert {(2112, 7168), (7168, 2048), (24576, 1536), (7168, 16384), (4096, 7168)} <= nk  # DeepSeek-V3
    assert by_key[("llama3-70b", "qkv", 1)] == (10240, 8192) and by_key[("llama3-70b", "qkv", 8)] == (1280, 8192)
    assert by_key[("llama3-8b", "gate_up", 1)] == (28672, 4096) and by_key[("llama3-405b", "down", 8)] == (16384, 6656)
    assert by_key[("deepseek-v3", "q_b", 8)] == (3072, 1536) and by_key[("deepseek-v3", "o", 8)] == (7168, 2048)
    assert by_key[("qwen3-235b-a22b", "kv", 8)] == (128, 4096)  # 4 K/V heads: replicated at TP 8
    assert by_key[("gpt-oss-120b", "qkv", 1)] == (5120, 2880) and by_key[("mixtral-8x7b", "expert_down", 1)] == (4096, 14336)
    sharded = 0
    for (model, layer, tp), (n, k) in by_key.items():
        if tp == 1:
            continue
        sharded += 1
        n1, k1 = by_key[(model, layer, 1)]
        if layer == "o" or layer.endswith("down"):  # row-parallel: K split
            assert n == n1 and k * tp == k1, (model, layer, tp)
        elif layer in ("kv", "qkv"):  # heads split; K/V heads replicated below one per rank
            assert k == k1 and n * tp >= n1 and (layer == "qkv" or n1 % n == 0), (model, layer, tp)
        else:  # column-parallel: N split
            assert k == k1 and n * tp == n1, (model, layer, tp)
        assert n % 8 == 0 and k % 8 == 0
    assert sharded >= 100


def test_sweep_grouped_rows(sweep):
    full, quick = sweep.grouped_rows(), sweep.grouped_rows(quick=True)
    for rows, balanced, ragged in ((full, 30, 4), (quick, 5, 1)):
        assert sum(r["routing"] == "balanced" for r in rows) == balanced
        assert sum(r["routing"] == "zipf" for r in rows) == ragged
        keys = [(r["groups"], r["tokens_per_group"], r["n"], r["k"], r["routing"]) for r in rows]
        assert len(set(keys)) == len(keys)
        for g, per, n, k, _ in keys:
            assert g in sweep.GROUPS and per in sweep.TOKENS_PER_GROUP
            assert g * per <= sweep.GROUPED_TOKENS_CAP and 2.0 * g * per * n * k <= sweep.GROUPED_FLOP_CAP
    assert {r["groups"] for r in full} == set(sweep.GROUPS)
    assert {r["tokens_per_group"] for r in full} == set(sweep.TOKENS_PER_GROUP)
    assert {(r["n"], r["k"]) for r in full} == {(n, k) for _, n, k, _ in sweep.MOE_NK}
    experts = {(n, k): e for _, n, k, e in sweep.MOE_NK}
    assert all(r["groups"] <= experts[(r["n"], r["k"])] for r in full + quick)  # a model has that many
    assert {(2048, 7168), (7168, 2048)} <= {(r["n"], r["k"]) for r in quick + full}
    assert full == sweep.grouped_rows()
    assert sweep.user_grouped_rows([(8, 128, 256, 512)]) == [
        {"name": "user", "groups": 8, "tokens_per_group": 128, "n": 256, "k": 512, "routing": "balanced"}]


def _dense_row(m, ratio, host_ratio=1.0, backend="cutlass:128x256", n=4096, k=4096):
    return {"shape": {"m": m, "n": n, "k": k, "dtype": "bf16", "layer": f"x.m{m}/tp1", "also": []},
            "distgemm": {"ms": 1.0, "tflops": 1.0}, "cublas": {"ms": ratio, "tflops": 1.0},
            "ratio": ratio, "host_ms": {"distgemm": 0.02, "cublas": 0.02 * host_ratio},
            "host_ratio": host_ratio, "backend": backend}


def test_sweep_summarize_dense(sweep):
    rows = [_dense_row(1, 2.0, 0.5), _dense_row(100, 0.5, 2.0, "cublas", n=2112, k=7168),
            _dense_row(4096, 1.0, 1.0), _dense_row(8192, 4.0, 0.25, None),
            {"shape": {"m": 7, "n": 8, "k": 8, "dtype": "bf16", "layer": "x", "also": []}, "error": "OOM"}]
    s = sweep.summarize_dense(rows)
    assert s["bf16_vs_cublas"] == pytest.approx(2 ** 0.5, abs=1e-4)  # geomean of 2, 0.5, 1, 4
    assert s["bf16_vs_cublas_min"] == 0.5 and s["bf16_vs_cublas_min_shape"] == "100x2112x7168"
    assert s["bf16_vs_cublas_min_layer"] == "x.m100/tp1" and s["bf16_vs_cublas_max"] == 4.0
    assert s["bf16_vs_cublas_m_ge_2048"] == pytest.approx(2.0) and s["bf16_vs_cublas_m_le_256"] == pytest.approx(1.0)
    assert s["bf16_host_vs_torch"] == pytest.approx((0.5 * 2.0 * 1.0 * 0.25) ** 0.25, abs=1e-4)
    assert s["bf16_host_vs_torch_min"] == 0.25 and s["bf16_host_vs_torch_min_shape"] == "8192x4096x4096"
    assert s["backends"] == {"cutlass:128x256": 2, "cublas": 1, "None": 1}
    assert s["rows"] == 4 and s["rows_failed"] == 1
    assert sweep.summarize_dense([_dense_row(4096, 1.1)])["bf16_vs_cublas_m_le_256"] is None
    empty = sweep.summarize_dense([])
    assert empty["bf16_vs_cublas"] is None and empty["bf16_vs_cublas_min_shape"] is None


def _grouped_row(pass_name, g, per, routing="balanced", **ratios):
    return {"shape": {"name": "x", "groups": g, "tokens_per_group": per, "n": 256, "k": 512, "routing": routing,
                      "pass": pass_name}, "distgemm": {"ms": 1.0, "tflops": 1.0}, "ratios": ratios}


def test_sweep_summarize_grouped(sweep):
    rows = [_grouped_row("forward", 8, 128, bmm=2.0, torch_grouped_mm=1.0),
            _grouped_row("forward", 16, 256, bmm=0.5, torch_grouped_mm=4.0),
            _grouped_row("dgrad", 8, 128, bmm=1.5, torch_grouped_mm=1.0),
            _grouped_row("wgrad", 8, 128, bmm=0.8),
            _grouped_row("wgrad", 16, 256, bmm=1.25),
            _grouped_row("forward", 32, 2048, "zipf", torch_grouped_mm=0.25),
            {"shape": {**_grouped_row("dgrad", 4, 4)["shape"]}, "error": "boom"}]
    s = sweep.summarize_grouped(rows)
    assert s["forward_vs_bmm"] == pytest.approx(1.0) and s["forward_vs_bmm_min"] == 0.5
    assert s["forward_vs_bmm_min_shape"] == "16x256x256x512"
    assert s["dgrad_vs_bmm"] == pytest.approx(1.5) and s["dgrad_vs_bmm_min"] == 1.5
    assert s["wgrad_vs_bmm"] == pytest.approx(1.0) and s["wgrad_vs_bmm_min"] == 0.8
    assert s["forward_vs_torch_grouped_mm"] == pytest.approx(1.0)  # geomean of 1, 4, 0.25 (ragged included)
    assert s["forward_vs_torch_grouped_mm_min_shape"] == "32x2048x256x512 (zipf)"
    assert s["forward_vs_torch_grouped_mm_balanced"] == pytest.approx(2.0)
    assert s["forward_vs_torch_grouped_mm_ragged"] == pytest.approx(0.25)
    assert s["rows_failed"] == 1
    assert sweep.summarize_grouped([])["wgrad_vs_bmm"] is None


def test_sweep_summarize_grouped_kernel_alone(sweep):
    """distgemm's kernels alone (no torch._grouped_mm stand-in) are summarized apart, and the
    rows the default backend answered with torch._grouped_mm are counted."""
    rows = [_grouped_row("forward", 8, 128, bmm=1.0), _grouped_row("forward", 16, 256, bmm=1.0)]
    rows[0].update(kernel_ratios={"bmm": 0.8}, backend="torch._grouped_mm")
    rows[1].update(kernel_ratios={"bmm": 0.5}, backend="cutlass:coop_128x256_c2x1")
    s = sweep.summarize_grouped(rows)
    assert s["kernel_forward_vs_bmm"] == pytest.approx((0.8 * 0.5) ** 0.5, rel=1e-3)
    assert s["kernel_forward_vs_bmm_min"] == 0.5
    assert s["kernel_dgrad_vs_bmm"] is None
    assert s["backends"] == {"torch": 1, "distgemm": 1}


def test_sweep_plots_write_files(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_dense_row(1, 2.0), _dense_row(100, 0.5, backend="cublas"), _dense_row(4096, 1.0, backend=None),
            {"shape": {"m": 7, "n": 8, "k": 8}, "error": "OOM"}]
    sweep.plot_dense(str(tmp_path / "dense.png"), "t", rows)
    grouped = [_grouped_row("forward", 8, 128, bmm=2.0, torch_grouped_mm=1.0), _grouped_row("wgrad", 8, 128, bmm=0.8),
               _grouped_row("forward", 32, 2048, "zipf", torch_grouped_mm=0.25)]
    sweep.plot_grouped(str(tmp_path / "grouped.png"), "t", grouped)
    assert (tmp_path / "dense.png").stat().st_size > 0 and (tmp_path / "grouped.png").stat().st_size > 0


# ---------------------------------------------------------------- FP8 tensor-parallel suite helpers


@pytest.mark.parametrize("kind", ["ag", "rs"])
@pytest.mark.parametrize("row_wise", [False, True])
def test_tp_fp8_operands_pass_scaled_mm_checks_and_the_reference_dequantizes(kind, row_wise):
    """The FP8 TP suite's shards and scales are in torch._scaled_mm's forms (checked on meta
    tensors, as the sequential peer and the GEMM alone call it), and its reference scales a per
    row and b per row (= per output column)."""
    import torch

    from distgemm.bench import tp_suite

    m, k, n, world = 256, 128, 384, 2
    x = tp_suite.fp8_shards(kind, m, k, n, world, row_wise, device="cpu")
    a, b, sa, sb = x["a"], x["b"], x["sa"], x["sb"]
    rows = m // world if kind == "ag" else m
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape[0] == rows
    assert sa.shape == ((rows, 1) if row_wise else ()) and sb.shape == ((1, b.shape[0]) if row_wise else ())
    out = torch._scaled_mm(_meta(a), _meta(b).T, _meta(sa), _meta(sb), out_dtype=torch.bfloat16)
    assert out.shape == (rows, b.shape[0])
    want = torch.stack([torch.stack([(a[i].float() * sa.reshape(-1)[i if row_wise else 0]) @
                                     (b[j].float() * sb.reshape(-1)[j if row_wise else 0])
                                     for j in range(0, b.shape[0], 97)]) for i in range(0, rows, 61)])
    got = tp_suite.fp8_reference(a, sa, b, sb)[::61, ::97]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)



def test_moe_kernel_classes_file_each_kernel_by_what_it_does():
    # Kernel names as the profiler gives them on the H200. distgemm's own kernels hold "gemm" in
    # their namespace, so the memory-bound passes must be matched before the GEMMs.
    from distgemm.bench.moe_suite import tabulate_kernels

    names = {
        "void distgemm::moe::(anonymous namespace)::act_pipelined_kernel<0, (__nv_fp8_interpretation_t)0>": "quantize / activation",
        "void distgemm::moe::(anonymous namespace)::weight_pipelined_kernel<(__nv_fp8_interpretation_t)0>": "quantize / activation",
        "void distgemm::moe::(anonymous namespace)::act_kernel<3, (__nv_fp8_interpretation_t)0>": "quantize / activation",
        "distgemm::quant::(anonymous namespace)::group_ends_kernel(int const*, long, long, int*)": "quantize / activation",
        "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShape": "gemm",
        "void at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>":
            "permute / unpermute (gather, scatter-add, sort)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "memset / fill (main_grad zeroed)",
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>": "copy / cast",
        "void distgemm::moe::(anonymous namespace)::combine_kernel<__nv_bfloat16>(distgemm::moe::CombineProblem, bool)":
            "permute / unpermute (gather, scatter-add, sort)",
        "void distgemm::moe::(anonymous namespace)::combine_backward_kernel<__nv_bfloat16>":
            "permute / unpermute (gather, scatter-add, sort)",
        "some_unknown_kernel": "other",
    }
    kernels = {name: [1.0 + i, 2.0] for i, name in enumerate(names)}
    rows, classes = tabulate_kernels(kernels)
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert all(r["calls"] == 2 for r in rows)
    want = {}
    for i, cls in enumerate(names.values()):
        want[cls] = want.get(cls, 0.0) + 3.0 + i
    assert classes == pytest.approx(want)


def test_gpu_span_counts_the_time_no_kernel_runs():
    from distgemm.bench.moe_suite import gpu_span

    assert gpu_span([]) == {"span_us": 0.0, "idle_us": 0.0}
    # back to back, a gap of 5, then two overlapping kernels (other streams) counted once
    assert gpu_span([(0.0, 10.0), (10.0, 20.0), (25.0, 30.0), (28.0, 40.0)]) == {"span_us": 40.0, "idle_us": 5.0}
    # one kernel inside another's interval; order of the events does not matter
    assert gpu_span([(50.0, 60.0), (0.0, 100.0), (120.0, 130.0)]) == {"span_us": 130.0, "idle_us": 20.0}


def test_moe_kernel_table_reports_per_step_over_back_to_back_steps(monkeypatch):
    """kernel_table profiles several steps as the timed rounds run them (no sync between) and
    reports per step: kernel times and calls, classes, span and idle (gaps between steps too)."""
    import contextlib
    import types

    import torch
    import torch.profiler

    from distgemm.bench import moe_suite

    steps, clock, events = [], [0.0], []

    def step():  # one step: a GEMM of 10 us and a fill of 2, a 1 us gap between them
        steps.append(1)
        start = clock[0]
        for name, length, gap in (("cutlass_gemm", 10.0, 1.0), ("FillFunctor", 2.0, 4.0)):
            events.append(types.SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                                                device_time_total=length,
                                                time_range=types.SimpleNamespace(start=start, end=start + length)))
            start += length + gap
        clock[0] = start

    class FakeProfile(contextlib.AbstractContextManager):
        def __init__(self, activities):
            events.clear()

        def __exit__(self, *exc):
            return False

        def events(self):
            return list(events)

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rows, classes, span = moe_suite.kernel_table(step, steps=3)
    assert len(steps) == 4  # one unprofiled, three profiled
    assert {r["kernel"]: (r["calls"], r["us"]) for r in rows} == {"cutlass_gemm": (1, 10.0), "FillFunctor": (1, 2.0)}
    assert sum(classes.values()) == pytest.approx(12.0)
    # three steps of 17 us, the last one's trailing 4 us gap outside the span: (51 - 4) / 3, idle (15 - 4) / 3
    assert span == {"span_us": round(47 / 3, 1), "idle_us": round(11 / 3, 1)}


def test_moe_peak_counts_the_gradients_a_step_allocates(monkeypatch):
    """A layer that allocates its .grad in the step (set to None at the step's start) has them
    counted: the previous step's are freed before the base is read, not inside the measurement."""
    import torch

    from distgemm.bench import moe_suite

    mib = 2 ** 20
    mem = {"now": 1000 * mib, "peak": 0}

    def allocate(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    class Param:
        def __init__(self):
            self._grad = torch.empty(0)  # the last step's gradient, 672 MiB
            allocate(672 * mib)

        @property
        def grad(self):
            return self._grad

        @grad.setter
        def grad(self, value):
            if self._grad is not None:
                allocate(-672 * mib)
            if value is not None:
                allocate(672 * mib)
            self._grad = value

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: mem["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: mem["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: mem.update(peak=mem["now"]))
    p = Param()

    def step():
        p.grad = None
        allocate(100 * mib)  # activations
        p.grad = torch.empty(0)  # this step's gradient
        allocate(-100 * mib)
    step.params = [p]
    assert moe_suite._peak_mb(step) == 772.0
