"""Data-parallel runs on CPU with gloo: torch's DDP gradient equals a single-process reference over the same kept
rows with the global-batch denominator (each process normalises by global/W, DDP averages); InfoBatch state merges so that plans agree on every process;
`torchrun -m capskip train --ddp` runs end to end; and a run that diverges on one process stops all of them together."""
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent('''
    import sys, torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel
    from capskip.runs.distributed import init_distributed
    from capskip.runs.data import digits_splits
    from capskip.runs.models import create_model
    from capskip.policies import create_policy

    out = sys.argv[1]
    dist = init_distributed('cpu')
    r, W = dist.rank, dist.world_size
    splits = digits_splits()
    torch.manual_seed(0)
    model = create_model('digits_cnn', num_classes=10)
    dist.broadcast_parameters(model)
    # 1) one step of CAPSkip on unequal shards of a 64-row global batch
    cuts = [0, 40, 64]
    idx = torch.arange(cuts[r], cuts[r + 1])
    x, y = splits.train.images[idx], splits.train.labels[idx]
    policy = create_policy('capskip', dist.wrap(model), seed=5, budget=0.5, rank=r, world_size=W)
    stats = policy.step(x, y, idx, denominator=64 / W)   # DDP averages: (1/W) Σ_r Σ_kept / (64/W) = Σ_kept / 64
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # 2) InfoBatch: an epoch of forwards on this rank's shard, then the merge; the next plan must agree
    ib = create_policy('infobatch', dist.wrap(model), seed=3, rank=r, world_size=W)
    n_rows = 300
    plan = ib.plan_epoch(0, 4, n_rows, 32)
    dist.snapshot_policy(ib)
    for b in plan.batches:
        ib.step(splits.train.images[b], splits.train.labels[b], b)
        model.zero_grad(set_to_none=True)
    dist.sync_policy(ib, n_rows)
    nxt = ib.plan_epoch(1, 4, n_rows, 32)
    # 3) the epoch's counters, as the runner reduces them: only rank 1 had steps whose backward ran every row
    own = {'rows_forwarded': 40.0 - 16 * r, 'rows_backprop': 10.0 + r, 'loss_sum': 1.0 + r, 'mean_distortion': 0.1 * (r + 1),
           'steps': 3.0, **({'all_rows_steps': 2.0} if r == 1 else {})}
    counted, correct = dist.reduce_counters(own, torch.tensor(3 + r))
    torch.save({'counted': counted, 'correct': correct,
                'grads': grads, 'applied': stats.applied, 'idx': idx, 'kept': stats.kept,
                'scores': ib.state_dict()['scores'], 'plan0': torch.cat(plan.batches),
                'plan1': torch.cat(nxt.batches), 'weights1': nxt.weights}, f'{out}/rank{r}.pt')
    dist.close()
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def launch(script: Path, args: list[str], world: int = 2, timeout: int = 150) -> None:
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1',
                   MASTER_PORT=str(port), OMP_NUM_THREADS='1')
        procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-3000:]


def rank_results(tmp: Path, worker: str, world: int = 2) -> list:
    "Run `worker` (a script taking the output folder) in `world` processes; what each saved as rank<r>.pt."
    script = tmp / 'worker.py'
    script.write_text(worker)
    launch(script, [str(tmp)], world=world)
    return [torch.load(tmp / f'rank{r}.pt', weights_only=True) for r in range(world)]


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('ddp'), WORKER)


def test_ddp_gradient_equals_single_process_reference(two_ranks):
    from capskip.runs.data import digits_splits
    from capskip.runs.models import create_model
    splits = digits_splits()
    torch.manual_seed(0)
    model = create_model('digits_cnn', num_classes=10)
    idx = torch.cat([t['idx'] for t in two_ranks])
    applied = torch.cat([t['applied'] for t in two_ranks]).float()
    assert 0 < int((applied > 0).sum()) < 64, 'the budget should drop some rows and keep others'
    assert sum(t['kept'] for t in two_ranks) == int((applied > 0).sum())
    logits = model(splits.train.images[idx])
    loss = (applied * F.cross_entropy(logits, splits.train.labels[idx], reduction='none')).sum() / 64  # global batch
    loss.backward()
    for name, p in model.named_parameters():
        for t in two_ranks:
            got = t['grads'][name]
            rel = float((got - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
            assert rel <= 1e-5, (name, rel)
    for name in two_ranks[0]['grads']:   # every process applies the same update
        assert torch.equal(two_ranks[0]['grads'][name], two_ranks[1]['grads'][name])


def test_infobatch_state_merges_and_plans_agree(two_ranks):
    a, b = two_ranks
    assert torch.equal(a['scores'], b['scores'])                      # merged per-row losses
    seen = torch.cat([a['plan0'], b['plan0']]).unique()
    assert len(seen) == 300 and bool((a['scores'][seen] != 1).all())   # every forwarded row has its loss
    assert torch.equal(a['weights1'], b['weights1'])                   # same pruning decisions on both
    union = torch.cat([a['plan1'], b['plan1']])
    kept = (a['weights1'] > 0).nonzero().flatten()
    assert set(union.tolist()) == set(kept.tolist())                   # shards cover the plan's rows
    assert len(set(a['plan1'].tolist()) & set(b['plan1'].tolist())) <= 1   # disjoint up to DistributedSampler padding
    assert 0 < len(kept) < 300


def test_epoch_counters_are_reduced_over_processes(two_ranks):
    "Rows and losses summed, the distortion averaged, all_rows_steps the most of any process even where process 0 has none."
    for res in two_ranks:
        c = res['counted']
        assert (c['rows_forwarded'], c['rows_backprop'], c['loss_sum'], c['steps'], int(res['correct'])) == (64, 21, 3, 3, 7)
        assert c['all_rows_steps'] == 2 and abs(c['kept_fraction'] - 21 / 64) < 1e-12 and abs(c['mean_distortion'] - 0.15) < 1e-12


def test_torchrun_train_end_to_end(tmp_path):
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).with_name('torchrun'))
    env = dict(os.environ, OMP_NUM_THREADS='1')
    cmd = [torchrun, '--nproc_per_node', '2', '--master_port', str(free_port()), '-m', 'capskip', 'train', '--ddp',
           '--recipe', 'digits_ib', '--arm', 'infobatch_capskip', '--seed', '1', '--epochs', '2', '--batch-size', '64', '--device', 'cpu',
           '--out', str(tmp_path), '--quiet']
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert 'falling back' not in proc.stdout + proc.stderr                      # reuse under torch's DDP, no re-forward
    from capskip.runs.runio import read_json, read_jsonl, run_dir
    folder = run_dir(tmp_path, 'digits_ib', 'infobatch_capskip', 1, 2)
    final, rows, config = read_json(folder / 'final.json'), read_jsonl(folder / 'results.jsonl'), read_json(folder / 'config.json')
    assert final['complete'] and config['meta']['world_size'] == 2
    n_train = 1257
    assert rows[0]['rows_forwarded'] >= n_train and rows[0]['rows_forwarded'] <= n_train + 1   # padding to 2 ranks
    assert 0 < rows[0]['rows_backprop'] <= rows[0]['rows_forwarded'] and final['test_acc'] is not None


DIVERGING = textwrap.dedent('''
    import json, sys
    import capskip.checks
    from capskip.runs.distributed import init_distributed
    from capskip.runs.recipes import resolve_config
    from capskip.runs.train import train

    dist = init_distributed('cpu')
    if dist.rank == 0:   # as on CUDA: no value checks, NaN flows on; rank 1 keeps the CPU checks and raises at the first NaN
        capskip.checks.values_checked = lambda *args: False
    cfg = resolve_config('digits', {'base_lr': 1e6, 'warmup': False}, arm='dense', seed=1, epochs=2, batch_size=128,
                         device='cpu')
    final = train(cfg, sys.argv[1], progress='none', dist=dist)
    json.dump(final, open(f'{sys.argv[1]}/rank{dist.rank}.json', 'w'))
    dist.close()
''')


def test_a_diverged_data_parallel_run_stops_every_process_together(tmp_path):
    "One process raises at the NaN, the other only sees it at the epoch's end: neither waits forever, both agree."
    script = tmp_path / 'diverge.py'
    script.write_text(DIVERGING)
    launch(script, [str(tmp_path)], timeout=150)
    finals = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in range(2)]
    same = [{k: v for k, v in f.items() if k != 'train_time_s'} for f in finals]   # each process times its own loop
    assert same[0] == same[1] and finals[0]['status'] == 'diverged' and finals[0]['diverged']['epoch'] == 1
    from capskip.runs.runio import read_json, run_dir
    assert read_json(run_dir(tmp_path, 'digits', 'dense', 1, 2) / 'final.json') == finals[0]   # process 0 writes
