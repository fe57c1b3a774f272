"""A tied embedding's gradient added into the head's (`capskip.engine.rewrites`, nbs/01eb_rewrites.ipynb): `reuse`'s
traced backward graphs of a tied language model carry `accumulate_rows` instead of `embedding_dense_backward` and an
add, and its gradients are plain autograd's (float64 models, so the tolerance is float64's): GPT-2 (tied), a
Llama with its head tied and a padding row whose positions appear in the kept rows, every row kept (the unsliced
graph). An embedding that scales each token's gradient by its count in the batch (`scale_grad_by_freq=True`) makes
`reuse` and `reforward` back-propagate every row, exact, and say so (before, both counted the kept rows' tokens
alone and gave a wrong gradient with no word)."""
import warnings

import pytest
import torch
import torch.nn as nn

import transformers                      # the hf extra (in dev): a missing package fails here, it is never skipped
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from capskip import CAPSkip
from capskip.engine.check import model_grads
from capskip.engine.reuse import cached_traces
from capskip.testing import grad_errors, sequence_grads

transformers.logging.set_verbosity_error()
B, L, VOCAB, PAD = 6, 8, 64, 0
LENGTHS = torch.tensor([8, 6, 8, 3, 8, 5])


def tied(name):
    torch.manual_seed(0)
    if name == 'gpt2':
        config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config).double()
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
                         eos_token_id=0, pad_token_id=PAD, tie_word_embeddings=True)
    return LlamaForCausalLM(config).double()


def padded_batch():
    "Right-padded ids, their mask and HF labels; every row starts with PAD (= BOS here, as where pad = bos or eos): the padding row's token at an attended, labelled position."
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(L)[None] < LENGTHS[:, None]).long()
    ids = torch.where(mask.bool(), torch.randint(1, VOCAB, (B, L), generator=g), PAD)
    ids[:, 0] = PAD
    return {'input_ids': ids, 'attention_mask': mask, 'labels': torch.where(mask.bool(), ids, -100)}


def graph_ops(skip) -> list[list]:
    "Per traced backward graph of `skip`'s engine (sliced and unsliced): the names of its calls."
    entries = [e for m in skip.engine.modules() for e in cached_traces(m) if not isinstance(e, str)]
    return [[getattr(n.target, '__name__', str(n.target)).split('.')[0] for n in gm.graph.nodes if n.op == 'call_function']
            for e in entries for gm in (e.bw, e.bw_full)]


def run(model, batch, budget):
    skip = CAPSkip(model, budget=budget, mode='reuse')
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)          # a fallback to reforward / a full backward warns: fail
        skip.loss(skip(**batch)).backward()
    return model_grads(model), skip.last.applied, graph_ops(skip)


def reference(model, batch, applied):
    labels = batch['labels']
    aligned = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return sequence_grads(model, {k: batch[k] for k in ('input_ids', 'attention_mask')}, aligned, applied)


@pytest.mark.parametrize('name', ['gpt2', 'llama'])
@pytest.mark.parametrize('budget', [0.5, 0.0])
def test_reuse_adds_the_tied_embedding_rows_into_the_head_gradient(name, budget):
    model, batch = tied(name), padded_batch()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    got, applied, ops = run(model, batch, budget)
    kept = int((applied > 0).sum())
    assert (0 < kept < B) if budget else kept == B                  # budget 0: every row, the unsliced graph
    untied = sum(isinstance(m, nn.Embedding) for m in model.modules()) - 1     # GPT-2's position embedding
    assert ops and all(o.count('accumulate_rows') == 1 and o.count('embedding_dense_backward') == untied for o in ops), ops
    worst, glob = grad_errors(got, reference(model, batch, applied))
    assert worst <= 1e-12 and glob <= 1e-12, (name, budget, worst, glob)


def test_the_padding_mask_matters_to_that_check(monkeypatch):
    "The Llama batch above puts the padding row's token in kept rows: ignoring padding_idx there changes the gradient."
    import capskip.engine.rewrites as rewrites
    real = rewrites.accumulate_rows
    monkeypatch.setattr(rewrites, 'accumulate_rows', lambda acc, grad, index, padding_idx=-1: real(acc, grad, index, -1))
    model, batch = tied('llama'), padded_batch()
    got, applied, ops = run(model, batch, 0.0)
    assert all('<lambda>' in o for o in ops), ops                  # the graph calls the stand-in
    worst, _ = grad_errors(got, reference(model, batch, applied))
    assert worst > 1e-6, worst


class FreqTied(nn.Module):
    "A tied LM whose embedding scales each row's gradient by the inverse of its count (not rewritten)."
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, scale_grad_by_freq=True)
        self.mix, self.head = nn.Linear(16, 16), nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight
    def forward(self, ids): return self.head(torch.tanh(self.mix(self.emb(ids))))


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
@pytest.mark.parametrize('tie', [True, False])
def test_an_embedding_counting_tokens_over_the_batch_keeps_every_row(mode, tie, caplog):
    "scale_grad_by_freq=True divides by counts over the whole batch: both modes back-propagate every row (exact) and say so."
    torch.manual_seed(0)
    model = FreqTied().double()
    if not tie: model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    ids = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(2))
    skip = CAPSkip(model, budget=0.5, mode=mode)
    with caplog.at_level('WARNING', logger='capskip.engine'), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        skip.loss(skip(ids), labels).backward()
    got, applied = model_grads(model), skip.last.applied
    assert 0 < int((applied > 0).sum()) < B
    worst, glob = grad_errors(got, sequence_grads(model, {'ids': ids}, labels, applied))
    assert worst <= 1e-12 and glob <= 1e-12, (mode, tie, worst, glob)
    told = [r.getMessage() for r in caplog.records] + [str(w.message) for w in said]
    assert any('scale_grad_by_freq=True' in t for t in told), told
    if mode == 'reuse':
        ops = graph_ops(skip)
        assert ops and all('embedding_dense_backward' in o and 'accumulate_rows' not in o for o in ops), ops


class Bag(nn.Module):
    "A bag-of-tokens classifier (fastText-like): nn.EmbeddingBag over [B, L] ids, a linear head."
    def __init__(self, mode):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(VOCAB, 12, mode=mode), nn.Linear(12, 4)
    def forward(self, ids): return self.head(torch.tanh(self.bag(ids)))


def bag_reference(model, ids, y, keep):
    z = model(ids)
    ((torch.nn.functional.cross_entropy(z, y, reduction='none') * keep.double()).sum() / len(y)).backward()
    return model_grads(model)


@pytest.mark.parametrize('mode', ['reuse', 'reforward'])
@pytest.mark.parametrize('bag_mode', ['sum', 'mean', 'max'])
def test_an_embedding_bag_keeps_its_gradient(mode, bag_mode, caplog):
    "reuse sliced the bag's saved offsets and offset2bag without renumbering them (worst parameter 0.89 off, no word): it now runs every row; reforward numbers the kept rows afresh and saves."
    torch.manual_seed(0)
    model = Bag(bag_mode).double()
    ref = Bag(bag_mode).double()
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    with torch.no_grad(): y = model(ids).argmax(1)           # rows predicted right are candidates
    y[:2] = (y[:2] + 1) % 4
    skip = CAPSkip(model, budget=0.6, mode=mode)
    with caplog.at_level('WARNING', logger='capskip.engine'), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        skip.loss(skip(ids), y).backward()
    keep = ~skip.last.drop
    assert 0 < int(keep.sum()) < B
    worst, glob = grad_errors(model_grads(model), bag_reference(ref, ids, y, keep))
    assert worst <= 1e-12 and glob <= 1e-12, (mode, bag_mode, worst, glob)
    told = [r.getMessage() for r in caplog.records] + [str(w.message) for w in said]
    assert any('embedding bag' in t for t in told) == (mode == 'reuse'), told


@pytest.mark.parametrize('mode', ['masked', 'reforward', 'reuse'])
def test_a_flat_token_list_with_offsets_is_one_line(mode):
    "nn.EmbeddingBag(text, offsets) with a flat text: its dim 0 is not the rows; before, a torch RuntimeError from a 2-row forward."
    class TextClassifier(nn.Module):                        # as in torchtext's tutorial
        def __init__(self):
            super().__init__(); self.bag, self.fc = nn.EmbeddingBag(VOCAB, 12), nn.Linear(12, 4)
        def forward(self, text, offsets): return self.fc(self.bag(text, offsets))
    lengths = torch.tensor([3, 5, 2, 4, 6, 1])
    text = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=torch.Generator().manual_seed(1))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    skip = CAPSkip(TextClassifier(), budget=0.5, mode=mode)
    with pytest.raises(ValueError) as err:
        skip(text, offsets)
    text = str(err.value)
    assert '\n' not in text and 'TextClassifier failed on the first 2 rows' in text and 'padded [B, L]' in text, text
