"""`capskip check` on causal language models: a row is a sequence (logits [B, L, V], labels the next tokens, -100 on
padding). The reference is plain autograd of (1/N) Σ_i w_i Σ_t CE over labelled tokens (N: the batch's labelled tokens),
checked here against a brute force; the CLI builds GPT-2, Llama (RoPE, GQA) and Qwen2 from configs and finds every
mode exact on the kept sequences, and a wrong reference would be caught."""
import contextlib
import io

import pytest
import torch
import torch.nn.functional as F

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped

from capskip.cli.method import check_main
from capskip.engine.check import autograd_grads, grad_errors
from capskip.steps import shifted_labels
from capskip.runs.text import example_inputs, hf_causal_lm, next_token_labels

transformers.logging.set_verbosity_error()


def lm_case(name='gpt2-tiny-lm', batch=6):
    torch.manual_seed(0)
    model = hf_causal_lm(name)
    x = example_inputs(model, batch, 32, torch.Generator().manual_seed(1))
    return model, x, shifted_labels(next_token_labels(x))


def test_sequence_reference_is_the_per_token_loss_over_labelled_tokens():
    model, x, y = lm_case()
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, 0.5])
    got = autograd_grads(model, x, y, w)
    model.zero_grad(set_to_none=True)
    z = model(**x).logits
    total = sum(w[i] * F.cross_entropy(z[i, t], y[i, t], reduction='sum')
                for i in range(len(y)) for t in range(y.shape[1]) if y[i, t] != -100)
    (total / (y != -100).sum()).backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    err, glob = grad_errors(got, ref)
    assert err < 1e-5 and glob < 1e-5, (err, glob)
    model.zero_grad(set_to_none=True)
    wrong = autograd_grads(model, x, y, w, denominator=float((y != -100).sum()) * 2)     # a control: half the gradient
    assert grad_errors(wrong, ref)[1] > 0.4


@pytest.mark.parametrize('name,mode', [('llama-tiny-lm', 'all'), ('qwen2-tiny-lm', 'reuse')])   # GPT-2: test_causal_lm
def test_check_cli_finds_every_mode_exact_on_causal_lms(name, mode):
    out = io.StringIO()
    with contextlib.redirect_stdout(out): rc = check_main(['--model', f'hf:{name}', '--batch', '6', '--keep', '0.5',
                                                           '--mode', mode])
    text = out.getvalue()
    assert rc == 0, text
    assert 'causal LM (labels: the next tokens)' in text.splitlines()[0]
    for m in (['reuse', 'reforward'] if mode == 'all' else [mode]): assert f'{m}: exact' in text, text
    assert 'fell back' not in text and 'keep 3 weighted        3' in text, text


def test_lm_flag_on_an_image_model_and_unknown_config_are_one_line(capsys):
    with pytest.raises(SystemExit) as e: check_main(['--model', 'digits_cnn', '--lm'])
    assert e.value.code == 2 and 'drop --lm' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e: check_main(['--model', 'hf:nosuch', '--lm'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'unknown causal-LM config' in err and 'Traceback' not in err


def test_a_config_larger_than_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    "A 7B Llama's config.json: one line naming its size and the fix, before anything is allocated (before: the check built 27 GB of float32 parameters, 4 copies of them, and the process was killed for its memory with no word)."
    import json
    import resource
    import capskip.cli.method as method
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(dict(model_type='llama', vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                    num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=4096)))
    monkeypatch.setattr(method, 'available_bytes', lambda device=None: 24 * 2**30)   # as on this 24 GiB machine, whatever runs the test
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SystemExit) as exit_:
        check_main(['--model', f'hf:{path}', '--lm'])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].startswith('capskip check: error: --model hf:') and 'builds 6.74B parameters' in said[-1], said
    assert '"num_hidden_layers": 2' in said[-1] and '100.4 GiB' in said[-1]
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024 < 2**30   # nothing of its size was allocated
    monkeypatch.setattr(method, 'available_bytes', lambda device=None: 2**40)        # a machine with 1 TiB free: no refusal
    assert method.too_big(method.meta_params(lambda: hf_causal_lm(str(path))), method.available_bytes()) is None


def test_a_config_larger_than_the_gpu_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    "With --device cuda the guard reads the GPU's free memory (torch.cuda.mem_get_info; before: no guard on a GPU, the build ran out of its memory with a traceback). Run here with that call standing in for a GPU with 16 GiB free."
    import json
    import torch
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(dict(model_type='llama', vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                    num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=4096)))
    asked = []
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device=None: (asked.append(device), (16 * 2**30, 80 * 2**30))[1])
    with pytest.raises(SystemExit) as exit_:
        check_main(['--model', f'hf:{path}', '--lm', '--device', 'cuda'])
    said = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and asked and 'builds 6.74B parameters' in said[-1], said
    assert 'and cuda (free memory) has 16.0 GiB available' in said[-1] and 'Traceback' not in '\n'.join(said)
