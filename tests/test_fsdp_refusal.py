"""FSDP is refused by name, whatever `ddp_check` says (capskip.engine.facade.fsdp_sharded), on 2 real gloo CPU
processes: FSDP2 (`fully_shard`) on the model or on a submodule only, a model sharded after `CAPSkip`/`Engine` was built
(refused at its first forward), and FSDP1 (`FullyShardedDataParallel`) as the wrapper passed in or applied afterwards.
Without the refusal, FSDP1 leaves every gradient None and FSDP2 each rank's own unreduced gradient."""
import textwrap

import pytest

from test_ddp import rank_results

WORKER = textwrap.dedent('''
    import copy, sys
    import torch, torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1, fully_shard
    import capskip
    from capskip.engine import Engine
    from capskip.runs.distributed import init_distributed

    out = sys.argv[1]
    dist = init_distributed('cpu')
    mesh = init_device_mesh('cpu', (dist.world_size,))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(dist.rank))
    fsdp1 = lambda m, **kw: FSDP1(m, device_id=torch.device('cpu'), **kw)

    def refusal(build, call=False):
        "The message of the error building (and, with call, calling) a CAPSkip/Engine; 'no error' if there is none."
        try:
            skip = build()
            if call: skip(x) if isinstance(skip, capskip.CAPSkip) else skip.forward(x)
            return 'no error'
        except Exception as err:
            return f'{type(err).__name__}: {err}'

    res = {}
    def fsdp2(root=True):
        m = copy.deepcopy(base); fully_shard(m[0], mesh=mesh)
        if root: fully_shard(m, mesh=mesh)
        return m
    for check in (True, False):                              # the user's door, CAPSkip, with and without ddp_check
        res[f'fsdp2 capskip ddp_check={check}'] = refusal(lambda: capskip.CAPSkip(fsdp2(), ddp_check=check))
        res[f'fsdp1 capskip ddp_check={check}'] = refusal(lambda: capskip.CAPSkip(fsdp1(copy.deepcopy(base)), ddp_check=check))
        def later(shard, check=check):
            m = copy.deepcopy(base); skip = capskip.CAPSkip(m, ddp_check=check); shard(m); return skip
        res[f'fsdp2 later ddp_check={check}'] = refusal(lambda: later(lambda m: fully_shard(m, mesh=mesh)), call=True)
        res[f'fsdp1 later use_orig_params={check} ddp_check={check}'] = refusal(   # both FSDP1 parameter layouts
            lambda: later(lambda m: fsdp1(m, use_orig_params=check)), call=True)
    res['fsdp2 submodule ddp_check=False'] = refusal(lambda: capskip.CAPSkip(fsdp2(root=False), ddp_check=False))
    res['fsdp2 engine ddp_check=False'] = refusal(lambda: Engine(fsdp2(), 'reuse', ddp_check=False))
    res['fsdp1 engine ddp_check=False'] = refusal(lambda: Engine(fsdp1(copy.deepcopy(base)), 'reforward', ddp_check=False))
    # control: with FSDP imported and a process group up, an unsharded model is not taken for FSDP
    res['plain ddp_check=False'] = refusal(lambda: capskip.CAPSkip(copy.deepcopy(base), ddp_check=False), call=True)
    torch.save(res, f'{out}/rank{dist.rank}.pt')
    dist.close()
''')


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    return rank_results(tmp_path_factory.mktemp('fsdp'), WORKER)


def test_fsdp_is_refused_by_name_whatever_ddp_check_says(ranks):
    for rank in ranks:
        refused = {k: v for k, v in rank.items() if k != 'plain ddp_check=False'}
        assert len(refused) == 11
        for case, message in refused.items():
            assert message.startswith('ValueError: capskip does not support FSDP yet'), (case, message)
            assert 'DistributedDataParallel' in message and '\n' not in message, (case, message)
            assert 'ddp_check=False does not lift this' in message, (case, message)
        assert 'module `0`' in rank['fsdp2 submodule ddp_check=False']           # names the sharded submodule
        assert '(FSDPSequential)' in rank['fsdp2 later ddp_check=False']        # the class fully_shard swapped in
        assert '(FullyShardedDataParallel)' in rank['fsdp1 capskip ddp_check=False']


def test_an_unsharded_model_is_not_taken_for_fsdp(ranks):
    assert [rank['plain ddp_check=False'] for rank in ranks] == ['no error', 'no error']
