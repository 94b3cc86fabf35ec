"""grpo/contrib/cpu/decode.py and sampling.py, the opt-in CPU tunings of decoding: the few-row kernel computes
F.linear, is used only where it applies and where `cpu_decode_kernel` is switched on, and generation with it gives
what generation with torch's products gives; `cpu_inverse_cdf_sampling`'s draw samples the rows' distributions and
answers only the single draws it can. Every tensor here is on the CPU, so the tests hold on a machine with a GPU; the
kernel's skip where torch reports no AVX512 capability (or no C compiler)."""

import pytest
import torch
import torch.nn.functional as F

from grpo.contrib.cpu import decode as cpu_linear
from grpo.contrib.cpu import sampling
from grpo.generation import TransformersGeneration, make_generation_backend
from grpo.testing import tiny_tokenizer

needs_kernel = pytest.mark.skipif(
    not cpu_linear.available(), reason="needs Linux x86-64, torch's AVX512 CPU capability and a C compiler"
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (2, 15), (7, 33), (1536, 576), (5, 1536)])
def test_kernel_matches_torch(rows, out_features, in_features):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, in_features), torch.randn(out_features, in_features), torch.randn(out_features)
    for b in (None, bias):
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
        got = cpu_linear.linear(x, weight, b)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * in_features**0.5)


@needs_kernel
def test_kernel_keeps_leading_dimensions_and_does_not_depend_on_threads():
    x, weight = torch.randn(2, 4, 576), torch.randn(1000, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear(x, weight)
        torch.set_num_threads(2)
        two = cpu_linear.linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert one.shape == (2, 4, 1000)
    assert torch.equal(one, two)  # each output's sum is taken in the same order whatever the split
    torch.testing.assert_close(one, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_only_plain_few_row_products_without_gradient_go_to_the_kernel(monkeypatch):
    calls = []
    kernel_linear = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(a[0].shape) or kernel_linear(*a))
    weight = torch.nn.Parameter(torch.randn(64, 32))  # as in nn.Linear
    cases = {
        "few rows": (torch.randn(8, 32), True),
        "3-d, 16 rows": (torch.randn(2, 8, 32), True),
        "17 rows": (torch.randn(17, 32), False),
        "float64": (torch.randn(4, 32, dtype=torch.float64), False),
        "not contiguous": (torch.randn(32, 4).t(), False),
    }
    with torch.no_grad(), cpu_linear.few_row_linear():
        for name, (x, routed) in cases.items():
            calls.clear()
            w = weight if x.dtype == torch.float32 else weight.to(x.dtype)
            out = F.linear(x, w)
            assert bool(calls) == routed, name
            torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype: torch's product
            F.linear(torch.randn(4, 32), weight)
        assert not calls
    x = torch.randn(4, 32, requires_grad=True)
    with cpu_linear.few_row_linear():
        F.linear(x, weight).sum().backward()  # a gradient is wanted: torch's product
    assert not calls and x.grad is not None
    with torch.no_grad():
        F.linear(torch.randn(4, 32), weight)  # outside the context
    assert not calls


def test_without_the_kernel_the_context_changes_nothing(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_kernel", lambda: None)
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: pytest.fail("kernel used without a kernel"))
    with torch.no_grad(), cpu_linear.few_row_linear():
        F.linear(torch.randn(4, 8), torch.randn(3, 8))


@needs_kernel
def test_generation_with_the_kernel_gives_torch_s_greedy_tokens(tiny_model_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not cpu_linear.pays_for(model)  # its weights fit in the caches: left to torch
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_BYTES", 0)  # as if they did not
    assert cpu_linear.pays_for(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_linear.pays_for(model)  # bf16 products: left to autocast
    calls = []
    kernel_linear = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(1) or kernel_linear(*a))
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    outputs = {}
    for kernel in (True, False):
        sampler = TransformersGeneration(
            max_completion_length=12, pad_token_id=0, eos_token_ids=[1], greedy=True, cpu_decode_kernel=kernel
        )
        calls.clear()
        outputs[kernel] = sampler.generate(model, prompts).ids
        assert bool(calls) == kernel
    assert outputs[True] == outputs[False]


def test_the_config_switches_reach_the_sampler_and_are_off_by_default(tmp_path):
    from grpo import GRPOConfig

    for value in (True, False):
        args = GRPOConfig(
            output_dir=str(tmp_path), cpu_decode_kernel=value, cpu_inverse_cdf_sampling=not value, report_to="none"
        )
        backend = make_generation_backend(args, None, tiny_tokenizer(), eos_token_ids=[1])
        assert backend.cpu_decode_kernel is value
        assert backend.cpu_inverse_cdf_sampling is not value
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    assert not (args.cpu_decode_kernel or args.cpu_inverse_cdf_sampling or args.keep_freed_cpu_memory)
    backend = make_generation_backend(args, None, tiny_tokenizer(), eos_token_ids=[1])
    assert not (backend.cpu_decode_kernel or backend.cpu_inverse_cdf_sampling)


def test_categorical_draws_from_the_rows_distribution():
    # Zero weights first, inside and last: never drawn. Unnormalised rows, as torch.multinomial accepts them.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0], [2.0, 0.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float32)
    draws = 200_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(probs, dtype=torch.float64)
    for _ in range(draws // 1000):
        picked = sampling.categorical(probs.repeat(500, 1), generator)
        assert picked.shape == (1000, 1) and picked.dtype == torch.int64
        rows = torch.arange(1000) % 2
        counts.index_put_((rows, picked[:, 0]), torch.ones(1000, dtype=torch.float64), accumulate=True)
    expected = probs.double() / probs.double().sum(1, keepdim=True)
    assert (counts[expected == 0] == 0).all()
    share = counts / counts.sum(1, keepdim=True)
    # Each share within 5 standard errors of its probability (about 0.005 at 100,000 draws per row).
    se = (expected * (1 - expected) / (draws / 2)).sqrt()
    assert ((share - expected).abs() <= 5 * se + 1e-12).all(), share


def test_categorical_is_seeded_and_picks_by_the_cumulative_sum():
    probs = torch.softmax(torch.randn(8, 1000), -1)
    one = sampling.categorical(probs, torch.Generator().manual_seed(3))
    assert torch.equal(one, sampling.categorical(probs, torch.Generator().manual_seed(3)))
    u = torch.rand(8, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cdf = probs.double().cumsum(-1)
    for r in range(8):  # the first index whose cumulative sum exceeds u x total
        v = int(one[r])
        assert cdf[r, v] > u[r] * cdf[r, -1] and (v == 0 or cdf[r, v - 1] <= u[r] * cdf[r, -1])


def test_categorical_leaves_invalid_weights_to_torch_s_error():
    for bad in (float("nan"), float("inf"), -0.1):
        probs = torch.tensor([[0.5, bad, 0.5]])
        assert sampling.categorical(probs) is None
        with pytest.raises(RuntimeError):
            torch.multinomial(probs, 1)
    assert sampling.categorical(torch.zeros(2, 3)) is None


@pytest.mark.parametrize("context", ["draws", pytest.param("kernel and draws", marks=needs_kernel)])
def test_the_context_answers_single_draws_and_leaves_the_rest_to_torch(context, monkeypatch):
    calls = []
    draw = sampling.categorical
    monkeypatch.setattr(sampling, "categorical", lambda *a: calls.append(a[0].shape) or draw(*a))
    probs = torch.softmax(torch.randn(4, 50), -1)
    opened = sampling.inverse_cdf_draws() if context == "draws" else cpu_linear.few_row_linear(draws=True)
    with opened:
        assert torch.multinomial(probs, num_samples=1).shape == (4, 1)
        assert probs.multinomial(1).shape == (4, 1)
        assert len(calls) == 2
        assert torch.multinomial(probs, 3).shape == (4, 3)  # several samples: torch's
        assert torch.multinomial(probs[0], 1).shape == (1,)  # one row, 1-d: torch's
        assert len(calls) == 2
        with pytest.raises(RuntimeError):  # `categorical` declines a NaN row: torch's own error, not a silent draw
            torch.multinomial(torch.tensor([[0.5, float("nan")]]), 1)
        assert len(calls) == 3
    torch.multinomial(probs, 1)  # outside the context
    assert len(calls) == 3


@needs_kernel
def test_the_kernel_s_context_leaves_the_draws_to_torch_unless_asked(monkeypatch):
    monkeypatch.setattr(sampling, "categorical", lambda *a: pytest.fail("a draw answered without draws=True"))
    with cpu_linear.few_row_linear():
        assert torch.multinomial(torch.softmax(torch.randn(4, 50), -1), 1).shape == (4, 1)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)])
def test_sampled_generation_with_the_draws_switched_on_draws_only_allowed_tokens(kernel, tiny_model_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not sampling.pays_for(model)  # its draws are small: left to torch
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(sampling, "MIN_WEIGHT_BYTES", 0)  # as if they were not
    assert sampling.pays_for(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not sampling.pays_for(model)  # as the kernel: no context under autocast
    calls, products = [], []
    draw, kernel_linear = sampling.categorical, cpu_linear.linear
    monkeypatch.setattr(sampling, "categorical", lambda *a: calls.append(1) or draw(*a))
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: products.append(1) or kernel_linear(*a))
    sampler = TransformersGeneration(
        max_completion_length=8,
        pad_token_id=0,
        eos_token_ids=[1],
        temperature=1.0,
        top_k=3,
        cpu_decode_kernel=kernel,
        cpu_inverse_cdf_sampling=True,
    )
    torch.manual_seed(0)
    completions = sampler.generate(model, [[5, 6, 7, 8], [9, 10, 11]])
    assert calls  # the draws went through `categorical`
    assert bool(products) == kernel  # the draws' switch alone opens no kernel
    # top_k=3: every drawn token is among the 3 most likely after its prefix
    for prompt, ids in zip([[5, 6, 7, 8], [9, 10, 11]], completions.ids):
        for t, token in enumerate(ids):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids[:t]])).logits[0, -1]
            assert token in logits.topk(3).indices.tolist()


# ---- Where the kernel cannot or must not be built (the review of issue 27) ----


@pytest.fixture
def fresh_kernel():
    """`_kernel` looked up afresh in the test, and again after it: its answer is cached for the process."""
    cpu_linear._kernel.cache_clear()
    yield
    cpu_linear._kernel.cache_clear()


def _never_compile(*args, **kwargs):
    pytest.fail("the kernel was compiled")


def test_without_torch_s_avx512_capability_nothing_is_compiled(fresh_kernel, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_linear.subprocess, "run", _never_compile)
    assert not cpu_linear.available()
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: pytest.fail("kernel used without a kernel"))
    with torch.no_grad(), cpu_linear.few_row_linear():
        F.linear(torch.randn(4, 8), torch.randn(3, 8))


def test_a_user_without_a_home_directory_gets_torch_s_products(fresh_kernel, monkeypatch):
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    # A machine where the kernel could be built, but no cache directory to build it into.
    monkeypatch.setattr(cpu_linear, "_supported", lambda: True)
    monkeypatch.setattr(cpu_linear.shutil, "which", lambda name: "/usr/bin/cc")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(cpu_linear.Path, "home", classmethod(no_home))
    monkeypatch.setattr(cpu_linear.subprocess, "run", _never_compile)
    assert not cpu_linear.available()


def test_a_cached_kernel_that_does_not_load_is_compiled_again_once(fresh_kernel, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_linear, "_supported", lambda: True)
    monkeypatch.setattr(cpu_linear.shutil, "which", lambda name: "/usr/bin/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library = cpu_linear._library(cpu_linear._cache_directory())
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF cut short")  # as a crash mid-copy would leave it
    builds = []
    # A build that leaves the file as broken as it was: the kernel is given up, not built again and again.
    monkeypatch.setattr(cpu_linear, "_build", lambda compiler, path: builds.append(path))
    assert not cpu_linear.available()
    assert builds == [library]


@needs_kernel
def test_a_damaged_cached_kernel_is_replaced_by_a_working_one(fresh_kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a path this process never loaded a library from
    library = cpu_linear._library(cpu_linear._cache_directory())
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF cut short")
    assert cpu_linear.available()
    assert library.stat().st_size > 1000  # compiled again in place
    x, weight = torch.randn(3, 40), torch.randn(7, 40)
    torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
