"""A loss term beside `skip.loss` (`capskip.engine.node.note_rule_rows`, `nbs/01k_node.ipynb`): a z-loss, an entropy
bonus or a distillation term on every row's logits sends gradient to rows the rule dropped. The backward runs them
(exact: plain autograd of the kept rows' cross-entropy plus the term), and says once that nothing was saved on them
while `StepStats.kept` counts the rule's rows (before: the same gradient, and the statistics claimed the skipped rows
with no word). A term on the kept rows alone, or on the parameters, gives no word. A term on every row makes the step save nothing:
`StepStats.all_rows` and the counters' `all_rows_steps` say so (before: False and 0, stop 54)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from capskip.engine.check import grad_errors, model_grads
from capskip.skip import CAPSkip
from capskip.testing import digits_tensors, trained_digits_mlp

transformers.logging.set_verbosity_error()
B, L, V = 6, 8, 64
MODES = ['reuse', 'reforward']
WORD = 'besides skip.loss sent gradient to'


def lm():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).double()


def lm_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g)
    return {'input_ids': ids, 'labels': ids}


def z_loss(z): return 1e-1 * z.logsumexp(-1).square().mean()               # PaLM's auxiliary z-loss, every row
def kept_z_loss(applied): return lambda z: z_loss(z[applied > 0])          # the same term on the kept rows alone
def one_dropped_z_loss(applied):                                           # the term on the kept rows and one dropped row
    rows = (applied > 0) | (torch.arange(len(applied)) == int((applied == 0).nonzero()[0]))
    return lambda z: z_loss(z[rows])
def entropy(z): return 1e-1 * (z.softmax(-1) * z.log_softmax(-1)).sum(-1).mean()


def lm_step(mode, term, record=True, every_row=None, budget=0.5):
    "One `skip.loss(...) + term(logits)` backward of the GPT-2 on float64: (its gradients, the applied weights, the kept count it recorded, the capskip warnings); `every_row`, a list, gets (StepStats.all_rows, the counters' all_rows_steps)."
    model = lm()
    skip = CAPSkip(model, budget=budget, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        z = skip(**lm_batch())
        loss = skip.loss(z)
        applied = skip.last.applied
        (loss + term(applied)(z) if term in (kept_z_loss, one_dropped_z_loss) else loss + term(z)).backward()
    if every_row is not None: every_row += [skip.last.all_rows, skip.counters().get('all_rows_steps', 0)]
    skip.close()
    return model_grads(model), applied, int(skip.last.kept), [str(w.message) for w in caught if 'capskip' in str(w.message)]


def digits_skip(mode):
    "The trained digits MLP on float64 under `CAPSkip(budget=0.3)`, and 64 of its rows: (model, skip, x, y)."
    X, Y, _, _ = digits_tensors()
    model = trained_digits_mlp().double()
    return model, CAPSkip(model, budget=0.3, mode=mode), X[:64].double(), Y[:64]


def said_of(caught): return [str(w.message) for w in caught if WORD in str(w.message)]


def lm_reference(applied, term):
    "Plain autograd on float64: the kept sequences' shifted token CE over the batch's labelled tokens, plus the term."
    model = lm()
    batch = lm_batch()
    z = model(input_ids=batch['input_ids']).logits
    y = batch['labels'][:, 1:]
    tok = F.cross_entropy(z[:, :-1].flatten(0, 1), y.flatten(), reduction='none').view(y.shape)
    loss = (tok.sum(1) * applied.double()).sum() / y.numel()
    (loss + term(applied)(z) if term in (kept_z_loss, one_dropped_z_loss) else loss + term(z)).backward()
    return model_grads(model)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('term', [z_loss, entropy], ids=['z_loss', 'entropy'])
def test_a_term_on_every_rows_logits_is_exact_and_said(mode, term):
    every_row = []
    got, applied, kept, said = lm_step(mode, term, every_row=every_row)
    dropped = int((applied == 0).sum())
    assert 0 < dropped < B and kept == B - dropped          # the record: the rule's rows
    top, rel = grad_errors(got, lm_reference(applied, term))
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    assert len(said) == 1 and f'{WORD} {dropped} row(s)' in said[0] and f'ran {B} of {B} rows' in said[0], said
    assert every_row == [True, 1]                           # nothing saved on this step, and its record says so (before: False, 0)


@pytest.mark.parametrize('mode', MODES)
def test_a_term_on_one_dropped_row_is_said_but_the_step_saved_the_others(mode):
    every_row = []
    got, applied, kept, said = lm_step(mode, one_dropped_z_loss, every_row=every_row, budget=0.9)
    dropped = int((applied == 0).sum())
    assert 1 < dropped < B and kept == B - dropped
    top, rel = grad_errors(got, lm_reference(applied, one_dropped_z_loss))
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    assert len(said) == 1 and f'{WORD} 1 row(s)' in said[0] and f'ran {B - dropped + 1} of {B} rows' in said[0], said
    assert every_row == [False, 0]                          # not every row: the other dropped rows were saved


@pytest.mark.parametrize('mode', MODES)
def test_a_term_on_the_kept_rows_alone_says_nothing(mode):
    got, applied, _, said = lm_step(mode, kept_z_loss)
    assert 0 < int((applied == 0).sum()) < B
    top, rel = grad_errors(got, lm_reference(applied, kept_z_loss))
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    assert said == []


@pytest.mark.parametrize('mode', MODES)
def test_a_classifier_with_a_z_loss(mode):
    model, skip, x, y = digits_skip(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for step in range(2):                                # warned once per engine
            model.zero_grad()
            z = skip(x)
            (skip.loss(z, y) + z_loss(z)).backward()
    applied = skip.last.applied
    dropped = int((applied == 0).sum())
    assert 0 < dropped < 64
    said = said_of(caught)
    assert len(said) == 1 and f'{WORD} {dropped} row(s)' in said[0], said
    ref = trained_digits_mlp().double()
    zr = ref(x)
    ((F.cross_entropy(zr, y, reduction='none') * applied.double()).sum().div(64) + z_loss(zr)).backward()
    top, rel = grad_errors(model_grads(model), model_grads(ref))
    assert top < 1e-12 and rel < 1e-12, (top, rel)
    skip.close()


@pytest.mark.parametrize('mode', MODES)
def test_a_cast_of_the_logits_is_followed_to_its_forward(mode):
    "`skip.loss(z.float(), y) + term(z.float())`: the rule's rows reach the node through the cast (`pass_chain`)."
    model, skip, x, y = digits_skip(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        z = skip(x).float()
        (skip.loss(z, y) + z_loss(z)).backward()
    dropped = int((skip.last.applied == 0).sum())
    said = said_of(caught)
    assert dropped > 0 and len(said) == 1 and f'{WORD} {dropped} row(s)' in said[0], said
    skip.close()


@pytest.mark.parametrize('mode', MODES)
def test_the_loop_that_shifts_the_logits_itself(mode):
    "`skip.loss(z[:, :-1], labels[:, 1:]) + z_loss(z)`, the common causal-LM loop: the rule's rows reach the node through the slice."
    model = lm()
    skip = CAPSkip(model, budget=0.5, mode=mode)
    ids = lm_batch()['input_ids']
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        z = skip(input_ids=ids)
        (skip.loss(z[:, :-1], ids[:, 1:]) + z_loss(z)).backward()
    dropped = int((skip.last.applied == 0).sum())
    said = said_of(caught)
    assert 0 < dropped < B and len(said) == 1 and f'{WORD} {dropped} row(s)' in said[0], said
    skip.close()
