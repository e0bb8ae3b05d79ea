"""Weight-only int8 and int4 (``kvcache_ext.weight_formats``, ``Pretrained.load(weights=)``, ``--weights``):
each quantized layer within the rounding bound of its format, the model's logits within the error that
bound implies, greedy text through ``kvcache-ext generate``, and the refusals."""

import pytest
import torch
from torch import nn

from kvcache_ext.cli import main
from kvcache_ext.pretrained import Pretrained
from kvcache_ext.weight_formats import Int4WeightLinear, quantize_weights
from python_ref import build_llama, build_mla
from python_ref.int4_weights import BLOCK as INT4_BLOCK
from python_ref.int8_activations import ACTIVATION_BLOCK, quantize_activations

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("transformers")  # writes the checkpoint directories

PROMPT = "The cat sat on the mat."
# bfloat16's unit roundoff (8 significant bits): rounding to it moves a value by at most this, relative.
BF16_ROUNDOFF = 2.0**-8


def quantization_step(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid spacing of each weight of ``weight`` (out, in) in ``weights``, and the most the bfloat16
    rounding of its stored scale can move it; from the format alone."""
    w = weight.double()
    if weights == "int8":  # symmetric per output channel: step amax / 127, |q| <= 127
        step = w.abs().amax(dim=1, keepdim=True) / 127
        return step.expand_as(w), (127 * step * BF16_ROUNDOFF).expand_as(w)
    # per block of 32 (python_ref.int4_weights): step amax / 8, codes -8 .. 7 of it
    step = w.view(w.shape[0], -1, INT4_BLOCK).abs().amax(dim=-1, keepdim=True) / 8
    step = step.expand(-1, -1, INT4_BLOCK).reshape(w.shape)
    return step, 8 * step * BF16_ROUNDOFF


def weight_error_bound(weight: torch.Tensor, weights: str) -> torch.Tensor:
    """The most each weight can move: half a step, plus the stored scale's rounding; in int4 a whole
    step for the values within a step of minus the block's largest (code 7 stands in for 8 there)."""
    step, stored = quantization_step(weight, weights)
    if weights == "int4":
        blocks = weight.double().view(weight.shape[0], -1, INT4_BLOCK)
        largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).expand_as(blocks).reshape(weight.shape)
        near_opposite = (weight.double() + largest).abs() < step
        return torch.where(near_opposite, step, step / 2) + stored
    return step / 2 + stored


def activation_error_bound(inputs: torch.Tensor) -> torch.Tensor:
    """The most each input moves where an int8 layer rounds its activations to int8 (half its block's
    step: python_ref.int8_activations)."""
    rows = inputs.reshape(-1, inputs.shape[-1])
    _, block_scales = quantize_activations(rows)
    step = block_scales.double().repeat_interleave(ACTIVATION_BLOCK, dim=1)[:, : rows.shape[1]]
    return (step / 2).view(inputs.shape)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_each_layer_within_its_rounding_bound(weights):
    model = build_llama("llama-tiny", seed=0, vocab_size=384).to(torch.bfloat16)
    originals = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_weights(model, weights)
    x = torch.randn(3, 5, model.cfg.emb_dim).to(torch.bfloat16)
    hidden = torch.randn(3, 5, model.cfg.hidden_dim).to(torch.bfloat16)
    checked = 0
    with torch.inference_mode():
        for name, weight in originals.items():
            layer = model.get_submodule(name)
            inputs = hidden if weight.shape[1] == hidden.shape[-1] else x
            exact = inputs.double() @ weight.double().T
            # each weight's error times its input, summed; then the output's own bfloat16 rounding
            bound = inputs.double().abs() @ weight_error_bound(weight, weights).T + exact.abs() * BF16_ROUNDOFF
            if isinstance(layer, Int4WeightLinear) or layer.integer_activations:  # each input's rounding too
                stored = weight.double().abs() + weight_error_bound(weight, weights)
                bound = bound + activation_error_bound(inputs) @ stored.T
            error = (layer(inputs).double() - exact).abs()
            assert (error <= bound).all(), f"{name}: error {error.max():.3g} over its bound"
            assert error.max() > 0  # the weights were quantized
            # not vacuous: well below the sum the error bounds are a fraction of
            assert bound.sum() < (inputs.double().abs() @ weight.double().abs().T).sum() / 4
            checked += 1
    assert checked == len(originals) == 7 * len(model.trf_blocks) + 1  # q, k, v, out, gate, up, down; head


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2"])  # untied, tied head, biases and GELU
def test_logits_close_to_bfloat16(checkpoint, weights, name):
    """To first order each matrix product adds its weight's relative error to the output's, so the
    logits' relative error is at most the sum, over the products on the longest path (two in each
    attention and each feed-forward, then the head), of the largest relative weight error of the
    format: rounding to a grid of step s errs by s / sqrt(12) in root mean square."""
    directory = checkpoint(name)
    reference = Pretrained.load(directory, weights="bf16", small_batch_linear=False)  # nn.Linear layers
    quantized = Pretrained.load(directory, weights=weights)
    linear = [m.weight.detach() for m in reference.model.modules() if isinstance(m, nn.Linear)]
    relative = max((quantization_step(w, weights)[0].norm() / 12**0.5 / w.double().norm()).item() for w in linear)
    depth = 4 * len(reference.model.trf_blocks) + 1
    ids = torch.tensor([reference.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        expected, got = reference.model(ids).double(), quantized.model(ids).double()
    error = ((got - expected).norm() / expected.norm()).item()
    assert error <= depth * relative, f"relative logits error {error:.3g}, bound {depth} x {relative:.3g}"
    assert error > 0  # the weights were quantized


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_generate_command_greedy_text(checkpoint, capsys, weights):
    """The cached decode of ``kvcache-ext generate --weights`` against the same quantized model re-reading
    the whole sequence at every token (no cache)."""
    directory = checkpoint("llama")
    new_tokens = 12
    status = main(
        ["generate", str(directory), "--prompt", PROMPT, "--max-new-tokens", str(new_tokens)] + ["--weights", weights]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    assert f"{weights} weights, torch.bfloat16 activations" in err
    pretrained = Pretrained.load(directory, weights=weights)
    ids = pretrained.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        for _ in range(new_tokens):
            token = int(pretrained.model(torch.tensor([ids]))[0, -1].float().argmax())
            ids.append(token)
            if token in pretrained.tokenizer.stop_ids:
                break
    generated = ids[len(pretrained.tokenizer.encode(PROMPT)) :]
    assert out == pretrained.tokenizer.decode(generated) + "\n"


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_engine_on_a_paged_cache_matches_the_stream(checkpoint, weights):
    """What ``chat`` and ``serve`` run (the Engine, chunked prompts, a paged cache) on quantized weights
    gives the tokens of the contiguous cache's loop."""
    pretrained = Pretrained.load(checkpoint("qwen3"), weights=weights)
    ids = pretrained.tokenizer.encode(PROMPT * 3)
    expected = list(pretrained.stream(ids, 16, pretrained.cache(1, len(ids) + 16), stop_ids=()))
    engine = pretrained.engine(num_blocks=32, block_size=4, chunk_size=5)
    request = engine.add_request(ids, 16)
    with torch.inference_mode():
        while not engine.is_finished(request):
            engine.step()
    assert engine.result(request).tokens == expected


def test_fingerprint_names_the_weight_format(checkpoint):
    directory = checkpoint("llama")
    prints = {w: Pretrained.load(directory, weights=w).fingerprint() for w in (None, "bf16", "int8")}
    assert len(set(prints.values())) == 3


def test_unknown_format_refused(checkpoint):
    with pytest.raises(ValueError, match=r"one of \['bf16', 'int8', 'int4'\], got 'fp8'"):
        Pretrained.load(checkpoint("llama"), weights="fp8")


def test_dtype_other_than_bfloat16_refused(checkpoint):
    with pytest.raises(ValueError, match=r"computes in bfloat16.*got dtype=torch.float32"):
        Pretrained.load(checkpoint("llama"), weights="int8", dtype=torch.float32)


def test_latent_attention_model_refused(checkpoint):
    with pytest.raises(ValueError, match=r"quantizes \['GPTModel', 'LlamaModel'\].*got a MLAModel"):
        Pretrained.load(checkpoint("deepseek_v2"), weights="int8")
    with pytest.raises(ValueError, match="got a MLAModel"):
        quantize_weights(build_mla(seed=0), "int4")


def test_int4_layer_off_the_block_size_refused():
    model = build_llama("llama-tiny", seed=0, hidden_dim=INT4_BLOCK * 3 + 8)
    with pytest.raises(ValueError, match=rf"'trf_blocks.0.ff.down' has {INT4_BLOCK * 3 + 8} input channels"):
        quantize_weights(model, "int4")


def test_generate_command_refusals(checkpoint, capsys):
    directory = str(checkpoint("llama"))
    status = main(["generate", directory, "--prompt", PROMPT, "--weights", "int8", "--dtype", "float16"])
    assert status == 2
    assert "got dtype=torch.float16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", directory, "--prompt", PROMPT, "--weights", "int2"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int2'" in capsys.readouterr().err
