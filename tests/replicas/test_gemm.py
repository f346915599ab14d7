"""replicas.layers.gemm: which GEMMs take cuBLAS's Lt front end, and that taking it changes nothing but speed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from replicas.layers import gemm


def test_row_range_from_the_environment(monkeypatch):
    monkeypatch.delenv("LORAFLEET_CUBLASLT_ROWS", raising=False)
    assert gemm.cublaslt_rows() == gemm.CUBLASLT_ROWS
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "8-32")
    assert gemm.cublaslt_rows() == (8, 32)
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "0")
    assert gemm.cublaslt_rows() is None
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "lots")
    with pytest.raises(ValueError, match="LORAFLEET_CUBLASLT_ROWS"):
        gemm.cublaslt_rows()


def test_cpu_rows_never_take_it(monkeypatch):
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "17-64")
    cpu = torch.zeros(32, 8, dtype=torch.bfloat16)
    assert not gemm.takes_cublaslt(cpu)  # no cuBLAS off the GPU
    torch.testing.assert_close(gemm.linear(cpu, torch.ones(4, 8, dtype=torch.bfloat16)),
                               torch.zeros(32, 4, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_only_cuda_half_precision_rows_in_range_take_it(monkeypatch):
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "17-64")
    for rows, takes in ((16, False), (17, True), (64, True), (65, False)):
        assert gemm.takes_cublaslt(torch.zeros(rows, 8, device="cuda", dtype=torch.bfloat16)) == takes
    assert gemm.takes_cublaslt(torch.zeros(4, 8, 8, device="cuda", dtype=torch.float16))  # 32 rows in 3-D
    assert not gemm.takes_cublaslt(torch.zeros(32, 8, device="cuda", dtype=torch.float32))
    monkeypatch.setenv("LORAFLEET_CUBLASLT_ROWS", "0")
    assert not gemm.takes_cublaslt(torch.zeros(32, 8, device="cuda", dtype=torch.bfloat16))


@pytest.mark.gpu  # cuBLAS front ends
@pytest.mark.parametrize("rows", [8, 24, 32, 64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_and_puts_the_setting_back(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(1040, 512, generator=g) / 512 ** 0.5).to("cuda", torch.bfloat16)  # 1,040: odd stacked rows
    b = torch.randn(1040, generator=g).to("cuda", torch.bfloat16) if bias else None
    before = torch.backends.cuda.preferred_blas_library()
    got = gemm.linear(x, w, b)
    assert torch.backends.cuda.preferred_blas_library() == before
    # another kernel may sum K in another order: float32 accumulators, one bf16 rounding apart
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-2, atol=1e-2)
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
