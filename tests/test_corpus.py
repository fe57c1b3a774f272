"""capskip.runs.corpus: the standard library's source as causal-LM and SFT rows — split by module with a seeded
generator, labels shifted by one with -100 exactly where nothing is learned, the hash/version note, SFT masking."""
import dataclasses
import math
import sys
import warnings

import pytest
import torch

from capskip.runs import corpus as C
from capskip.runs.data import create_splits, list_splits

MODS = ['bisect', 'colorsys', 'copy', 'fnmatch', 'heapq', 'keyword', 'netrc', 'queue', 'sched', 'shlex', 'textwrap', 'tty']
SMALL = dict(modules=MODS, val_fraction=0.25, test_fraction=0.25)
TOK = C.ByteTokenizer()


def stream(texts):
    return torch.cat([torch.cat([torch.tensor([TOK.bos_id]), TOK.encode(t), torch.tensor([TOK.eos_id])]) for t in texts])


# ---------------------------------------------------------------- the corpus, its hash and the version note
def test_default_corpus_reads_every_module_and_hashes_its_text():
    corpus = C.stdlib_corpus()
    assert corpus.names == C.STDLIB_MODULES == tuple(sorted(set(C.STDLIB_MODULES))) and len(corpus) == 108
    assert all(len(t) > 500 for t in corpus.texts)          # tty, the shortest, is 879 characters on 3.11
    assert corpus.python.endswith('.'.join(map(str, sys.version_info[:3])))
    assert corpus.sha256 == C.corpus_sha256(corpus.names, corpus.texts)
    texts = list(corpus.texts)
    texts[5] += ' '
    assert C.corpus_sha256(corpus.names, texts) != corpus.sha256                 # one changed byte changes the hash
    assert corpus.recorded == (C.RECORDED.get(corpus.python) == corpus.sha256)


def test_note_says_when_the_text_is_not_the_recorded_one_and_never_raises():
    corpus = C.stdlib_corpus()
    other = dataclasses.replace(corpus, python='CPython 3.99.0', sha256='f' * 64)
    same_version = dataclasses.replace(corpus, python=next(iter(C.RECORDED)), sha256='f' * 64)
    assert not other.recorded and 'no text recorded for this Python' in other.note() and 'differ' in other.note()
    assert 'differs from the one recorded for the same version' in same_version.note()
    assert 'custom module list' in C.stdlib_corpus(MODS).note()
    if corpus.recorded: assert 'is the recorded one' in corpus.note()
    C._NOTED.discard(other.sha256)
    with pytest.warns(UserWarning, match='no text recorded'): C.note_corpus(other)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        C.note_corpus(other)                                                      # once per process and text
        C.note_corpus(C.stdlib_corpus(MODS))                                      # a custom list: the caller's choice


def test_module_source_reads_the_stdlib_file_not_a_shadowing_one(tmp_path, monkeypatch):
    import colorsys, inspect
    (tmp_path / 'colorsys.py').write_text('FAKE = 1\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert C.module_source('colorsys') == inspect.getsource(colorsys)
    assert C.module_source('json.decoder').startswith('"""Implementation of JSONDecoder')


@pytest.mark.parametrize('modules, match', [(['no_such_module_q'], "'no_such_module_q': it is not in this interpreter"),
                                            ('random', 'non-empty list of module names'), ([], 'non-empty list')])
def test_bad_module_lists_get_one_line(modules, match):
    with pytest.raises(ValueError, match=match) as e: C.stdlib_corpus(modules)
    assert '\n' not in str(e.value)


# ---------------------------------------------------------------- the split by module
def test_split_is_deterministic_by_seed_and_a_partition_of_modules():
    a, b, c = (create_splits('stdlib_lm', seq_len=32, seed=s, **SMALL) for s in (0, 0, 1))
    assert [len(a.train.docs), len(a.val.docs), len(a.test.docs)] == [6, 3, 3]
    for x, y in zip((a.train, a.val, a.test), (b.train, b.val, b.test)):
        assert x.docs == y.docs and all(torch.equal(s, t) for s, t in zip(x.tensors, y.tensors))
    assert (a.val.docs, a.test.docs) != (c.val.docs, c.test.docs)
    for s in (a, c):
        docs = [s.train.docs, s.val.docs, s.test.docs]
        assert sorted(d for part in docs for d in part) == sorted(MODS)           # each module in exactly one split
        assert all(set(p).isdisjoint(q) for i, p in enumerate(docs) for q in docs[i + 1:])
    assert C.split_documents(108, seed=3)[1].tolist() == C.split_documents(108, seed=3)[1].tolist()


def test_sft_uses_the_same_module_split():
    lm = create_splits('stdlib_lm', seq_len=32, seed=2, **SMALL)
    sft = create_splits('stdlib_sft', seq_len=256, seed=2, **SMALL)
    for l, s in zip((lm.train, lm.val, lm.test), (sft.train, sft.val, sft.test)):
        assert set(s.docs) <= set(l.docs)
    assert len(sft.train) > 10


# ---------------------------------------------------------------- causal-LM rows
@pytest.mark.parametrize('pack', [True, False])
def test_lm_rows_shapes_shift_and_padding_exactly(pack):
    corpus = C.stdlib_corpus(MODS)
    L = 50
    splits = create_splits('stdlib_lm', seq_len=L, pack=pack, **SMALL)
    for rows in (splits.train, splits.val, splits.test):
        texts = [corpus.texts[corpus.names.index(d)] for d in rows.docs]
        docs = [stream(texts)] if pack else [stream([t]) for t in texts]
        assert len(rows) == sum(math.ceil((len(s) - 1) / L) for s in docs)
        for t in rows.tensors: assert t.shape == (len(rows), L) and t.dtype == torch.long
        real = rows.attention_mask == 1
        assert torch.equal(rows.input_ids[real], torch.cat([s[:-1] for s in docs]))   # every token but the last is an input
        assert torch.equal(rows.labels[real], torch.cat([s[1:] for s in docs]))       # ... labelled by the next one
        assert torch.equal(rows.labels == -100, ~real) and (rows.input_ids[~real] == TOK.pad_id).all()
        inner = real[:, 1:]
        assert torch.equal(rows.labels[:, :-1][inner], rows.input_ids[:, 1:][inner])   # shifted by one inside a row
        if pack:   # a packed row's last label is the next row's first input
            assert torch.equal(rows.labels[:-1, -1], rows.input_ids[1:, 0])
        hf = rows.batch(hf=True)['labels']
        assert torch.equal(hf[:, 1:], rows.labels[:, :-1]) and (hf[:, 0] == -100).all()


def test_max_rows_caps_each_split_to_its_first_rows():
    full = create_splits('stdlib_lm', seq_len=16, **SMALL)
    quick = create_splits('stdlib_lm', seq_len=16, max_rows=7, **SMALL)
    for f, q in zip((full.train, full.val, full.test), (quick.train, quick.val, quick.test)):
        assert len(q) == min(7, len(f)) and all(torch.equal(a[:7], b) for a, b in zip(f.tensors, q.tensors))


def test_full_corpus_splits_are_the_modules_streams():
    lm = create_splits('stdlib_lm', seq_len=256, max_rows=None)
    corpus = lm.corpus
    assert {'stdlib_lm', 'stdlib_sft'} <= set(list_splits('stdlib_*'))
    assert lm.vocab_size == 259 and [len(lm.train.docs), len(lm.val.docs), len(lm.test.docs)] == [86, 11, 11]
    test_stream = stream([corpus.texts[corpus.names.index(d)] for d in lm.test.docs])
    assert torch.equal(lm.test.input_ids[lm.test.attention_mask == 1], test_stream[:-1])


@pytest.mark.parametrize('kw, match', [(dict(seq_len=1), 'seq_len must be an int of at least 2'),
                                       (dict(max_rows=0), 'max_rows must be None'),
                                       (dict(val_fraction=1.0), 'val_fraction must lie in'),
                                       (dict(val_fraction=0.5, test_fraction=0.5), 'leave no training document'),
                                       (dict(seed=-3), 'seed must be an int'),
                                       (dict(tokenizer='gpt2'), "tokenizer must be 'bytes'")])
def test_bad_arguments_get_one_clear_line(kw, match):
    with pytest.raises(ValueError, match=match) as e: create_splits('stdlib_lm', modules=MODS, **kw)
    assert '\n' not in str(e.value)


# ---------------------------------------------------------------- SFT pairs and their masking
SRC = '''import functools

class Box:
    @functools.cache
    def area(self, scale=1):
        """Area of the box,
times scale."""
        # a comment
        return self.w * self.h * scale

    def stub(self):
        "Only a docstring."

    def todo(self):
        "Not yet."
        pass

async def fetch(url):
    "Fetch it."
    return await get(url)

def nodoc():
    return 1
'''


def test_function_pairs_are_signature_docstring_then_body():
    pairs = C.function_pairs('m', SRC)
    assert [p.name for p in pairs] == ['Box.area', 'fetch']
    area = pairs[0]
    assert area.prompt == 'def area(self, scale=1):\n    """Area of the box,\ntimes scale."""\n'   # no decorator
    assert area.completion == '    # a comment\n    return self.w * self.h * scale\n'
    assert pairs[1].prompt.startswith('async def fetch(url):') and pairs[1].doc == 'm'


def test_sft_labels_are_minus_100_exactly_on_prompt_and_padding():
    pairs = C.function_pairs('m', SRC)
    L = 128
    rows = C.sft_rows(pairs, TOK, L)
    assert len(rows) == 2 and rows.input_ids.shape == (2, L) and rows.docs == ('m',)
    for k, p in enumerate(pairs):
        seq = stream([p.prompt + p.completion])          # BOS prompt completion EOS (bytes: no merge across the seam)
        P = 1 + len(p.prompt.encode())
        assert int(rows.prompt_len[k]) == P and len(seq) <= L + 1
        n = len(seq) - 1
        assert torch.equal(rows.input_ids[k, :n], seq[:-1]) and (rows.attention_mask[k, :n] == 1).all()
        expected = torch.full((L,), -100)
        expected[P - 1:n] = seq[P:]                       # the first label counted is the completion's first token
        assert torch.equal(rows.labels[k], expected)
        assert TOK.decode(rows.labels[k][rows.labels[k] != -100]) == p.completion


def test_sft_truncates_long_pairs_and_drops_those_whose_prompt_fills_the_row():
    pair = C.function_pairs('m', SRC)[0]
    P = 1 + len(pair.prompt.encode())
    cut = C.sft_rows([pair], TOK, P + 3)
    assert (cut.attention_mask == 1).all() and int((cut.labels != -100).sum()) == 4
    assert TOK.decode(cut.labels[0, P - 1:]) == pair.completion[:4]
    assert len(C.sft_rows([pair], TOK, P - 1)) == 0 and C.sft_rows([pair], TOK, P - 1).input_ids.shape == (0, P - 1)
    assert len(C.sft_rows([pair] * 5, TOK, 256, max_rows=3)) == 3
    with pytest.raises(ValueError, match="module 'bad' does not parse"): C.function_pairs('bad', 'def f(:\n')


# ---------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trips_any_text():
    text = 'naïve — 日本語 \x00 tab\t\r\n😀'
    assert TOK.decode(TOK.encode(text)) == text and TOK.vocab_size == 259
    assert TOK.encode('').shape == (0,)


def test_bpe_tokenizer_is_trained_deterministically_on_training_modules():
    pytest.importorskip('tokenizers')
    texts = [C.module_source(m) for m in ('colorsys', 'bisect', 'keyword')]
    a, b = C.BPETokenizer(texts, 300), C.BPETokenizer(texts, 300)
    assert (a.bos_id, a.eos_id, a.pad_id) == (0, 1, 2) and a.vocab_size == 300
    assert torch.equal(a.encode(texts[0]), b.encode(texts[0])) and a.decode(a.encode(texts[1])) == texts[1]
    assert len(a.encode(texts[0])) < len(texts[0].encode())
    with pytest.raises(ValueError, match='vocab_size must be an int of at least 260'): C.BPETokenizer(texts, 100)


def test_bpe_without_the_package_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, 'tokenizers', None)
    with pytest.raises(ValueError, match='needs the tokenizers package: pip install tokenizers'):
        create_splits('stdlib_lm', tokenizer='bpe:512', **SMALL)


def test_hf_labels_give_a_shifting_model_the_same_loss():
    "`batch(hf=True)`: a Hugging Face causal LM, which shifts its labels itself, scores the same tokens as the shifted labels (all but each row's last)."
    transformers = pytest.importorskip('transformers')
    rows = C.sft_rows(C.function_pairs("m", SRC), TOK, 96)          # prompt masking and padding both present
    config = transformers.GPT2Config(vocab_size=TOK.vocab_size, n_positions=96, n_embd=16, n_layer=1, n_head=2)
    with torch.random.fork_rng():                                 # transformers initialises from the global generator
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).double().eval()
    batch = rows.batch(hf=True)
    with torch.no_grad():
        out = model(**batch)
        ours = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), rows.labels[:, :-1].flatten(),
                                                 ignore_index=-100)           # transformers computes its loss in float32
    assert len(rows) == 2 and (rows.labels[:, :-1] != -100).sum() > 40 and (rows.attention_mask == 0).any()
    torch.testing.assert_close(out.loss, ours, rtol=1e-6, atol=0)             # float32 round-off of two reduction orders
