"""DeepSpeed's functional comm API on 2 gloo ranks, called the way a DeepSpeed script does."""

from datetime import timedelta

import torch

from shardwise.testing import run_distributed


def _script_like(rank, world_size):
    import shardwise.comm as dist

    out = {
        "initialized": dist.is_initialized(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": dist.get_local_rank(),
        "backend": dist.get_backend(),
        "global_rank_of_1": dist.get_global_rank(None, 1),
        "all_ranks": dist.get_all_ranks_from_group(),
    }
    dist.barrier()
    dist.monitored_barrier()

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    m = torch.tensor([float(rank + 1)])
    dist.all_reduce(m, dist.ReduceOp.MAX, None, False)
    a = torch.tensor([float(rank + 1)])
    handle = dist.all_reduce(a, op=torch.distributed.ReduceOp.PRODUCT, async_op=True, log_name="grads", debug="caller")
    handle.wait()
    out["all_reduce"], out["max"], out["product"] = t.tolist(), m.tolist(), a.tolist()
    i = torch.tensor([float(rank + 1)])
    dist.inference_all_reduce(i)
    out["inference_all_reduce"] = i.tolist()
    pair = [torch.tensor([1.0 + rank]), torch.tensor([10.0 * (rank + 1)])]
    dist.all_reduce_coalesced(pair)
    out["coalesced"] = [x.tolist() for x in pair]

    r = torch.tensor([float(rank + 1)])
    dist.reduce(r, 0)
    out["reduce_on_0"] = r.tolist() if rank == 0 else None

    b = torch.arange(4.0) * (rank + 1)
    dist.broadcast(b, 1)
    out["broadcast"] = b.tolist()

    parts = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p.tolist() for p in parts]
    flat = torch.empty(2 * world_size)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    flat2 = torch.empty(world_size)
    dist.allgather_fn(flat2, torch.tensor([rank * 5.0]))
    outs = [torch.empty(world_size), torch.empty(2 * world_size)]
    dist.all_gather_coalesced(outs, [torch.tensor([float(rank)]), torch.full((2,), rank + 7.0)], async_op=True).wait()
    out["all_gather_into_tensor"], out["allgather_fn"] = flat.tolist(), flat2.tolist()
    out["all_gather_coalesced"] = [o.tolist() for o in outs]

    rs = torch.empty(2)
    dist.reduce_scatter(rs, [torch.full((2,), float(rank + 10 * r)) for r in range(world_size)])
    rst = torch.empty(2)
    dist.reduce_scatter_tensor(rst, torch.arange(2.0 * world_size) * (rank + 1))
    rsf = torch.empty(1)
    dist.reduce_scatter_fn(rsf, torch.arange(1.0 * world_size))
    out["reduce_scatter"], out["reduce_scatter_tensor"] = rs.tolist(), rst.tolist()
    out["reduce_scatter_fn"] = rsf.tolist()

    a2a = torch.empty(world_size)
    dist.all_to_all_single(a2a, torch.arange(world_size, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()

    g = [torch.empty(1) for _ in range(world_size)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 0.5]), g, 0)
    out["gather_on_0"] = [x.tolist() for x in g] if rank == 0 else None
    s = torch.empty(1)
    dist.scatter(s, [torch.tensor([100.0 + r]) for r in range(world_size)] if rank == 0 else None, 0)
    out["scatter"] = s.tolist()

    peer = 1 - rank
    msg = torch.tensor([float(rank)])
    if rank == 0:
        dist.send(msg + 40, peer)
        got = torch.empty(1)
        out["irecv_from"] = dist.irecv(got, peer)  # DeepSpeed's irecv blocks and returns the sender
    else:
        got = torch.empty(1)
        out["recv_from"] = dist.recv(got, peer)
        out["isend_returns"] = dist.isend(msg + 50, peer)  # DeepSpeed's isend blocks and returns None
    out["p2p"] = got.tolist()

    objs = [None, None]
    dist.all_gather_object(objs, {"rank": rank})
    blist = [f"from {rank}"]
    dist.broadcast_object_list(blist, 0)
    out["all_gather_object"], out["broadcast_object_list"] = objs, blist

    group = dist.new_group([0, 1])
    gt = torch.tensor([1.0])
    dist.all_reduce(gt, group=group)
    out["group"] = (dist.get_rank(group), dist.get_world_size(group), gt.tolist())
    mesh = dist.initialize_mesh_device((world_size,), ("dp",))
    out["mesh"] = (tuple(mesh.shape), mesh.mesh_dim_names)
    out["world_group_is_world"] = dist.get_world_group() is torch.distributed.group.WORLD

    # Synchronous calls return None as DeepSpeed's do, asynchronous ones torch's Work.
    out["sync_returns"] = [
        dist.all_reduce(torch.ones(1)),
        dist.broadcast(torch.ones(1), 0),
        dist.barrier(),
        dist.all_gather_into_tensor(torch.empty(world_size), torch.ones(1)),
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world_size)),
        dist.all_gather_object([None] * world_size, rank),
        dist.broadcast_object_list([rank], 0),
    ]
    works = [
        dist.all_reduce(torch.ones(1), async_op=True),
        dist.barrier(async_op=True),
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world_size), async_op=True),
    ]
    out["async_returns_work"] = [isinstance(work, torch.distributed.Work) for work in works]
    for work in works:
        work.wait()
    # The deadline: the group's own timeout (the harness's 60 s), then the shortest timeout
    # of a Communicator built over the group (as the engine's, from comm.timeout_s).
    from shardwise.comm import Communicator, _functional

    world = _functional._communicator(None)
    out["counted"] = {op: world.calls[op] for op in ("barrier", "all_reduce", "reduce_scatter_tensor")}
    out["deadline_of_group"] = world.timeout.total_seconds()
    Communicator(timeout_s=7.0, name="engine-like")
    dist.barrier()
    out["deadline_after_communicator"] = world.timeout.total_seconds()
    sub = torch.distributed.new_group([0, 1], timeout=timedelta(seconds=11))
    dist.all_reduce(torch.ones(1), group=sub)
    out["subgroup"] = (_functional._communicator(sub).timeout.total_seconds(), _functional._communicator(sub).name)
    return out


def test_deepspeed_style_script_on_two_ranks(tmp_path):
    results = run_distributed(_script_like, world_size=2, tmp_path=tmp_path)
    for rank, out in enumerate(results):
        assert out["initialized"] is True
        assert (out["rank"], out["world_size"], out["local_rank"]) == (rank, 2, rank)
        assert (out["backend"], out["global_rank_of_1"], out["all_ranks"]) == ("gloo", 1, [0, 1])
        assert out["all_reduce"] == [3.0] * 3
        assert (out["max"], out["product"]) == ([2.0], [2.0])
        assert out["inference_all_reduce"] == [3.0]
        assert out["coalesced"] == [[3.0], [30.0]]
        assert out["broadcast"] == [0.0, 2.0, 4.0, 6.0]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["allgather_fn"] == [0.0, 5.0]
        assert out["all_gather_coalesced"] == [[0.0, 1.0], [7.0, 7.0, 8.0, 8.0]]
        # rank r gets sum over senders s of (s + 10 r): 1 + 20 r
        assert out["reduce_scatter"] == [1.0 + 20 * rank] * 2
        # sum over s of (s + 1) * [0, 1, 2, 3] is 3 * [0, 1, 2, 3]; rank r keeps chunk r
        assert out["reduce_scatter_tensor"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert out["reduce_scatter_fn"] == [2.0 * rank]
        # rank r receives element r of each sender s: r + 10 s
        assert out["all_to_all_single"] == [float(rank), rank + 10.0]
        assert out["scatter"] == [100.0 + rank]
        assert out["p2p"] == ([51.0] if rank == 0 else [40.0])
        assert out["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert out["broadcast_object_list"] == ["from 0"]
        assert out["group"] == (rank, 2, [2.0])
        assert out["mesh"] == ((2,), ("dp",))
        assert out["world_group_is_world"] is True
    assert results[0]["reduce_on_0"] == [3.0]
    assert results[0]["gather_on_0"] == [[0.5], [1.5]]
    assert results[1]["recv_from"] == 0 and results[0]["irecv_from"] == 1
    assert results[1]["isend_returns"] is None
    for out in results:
        assert out["sync_returns"] == [None] * 7 and out["async_returns_work"] == [True] * 3
        # barrier: 2 calls; all_reduce: 2 + inference 1 + coalesced 2 + 1; reduce_scatter_tensor:
        # 2 + reduce_scatter_fn 1 (the async calls are not counted)
        assert out["counted"] == {"barrier": 2, "all_reduce": 6, "reduce_scatter_tensor": 3}
        assert (out["deadline_of_group"], out["deadline_after_communicator"]) == (60.0, 7.0)
        assert out["subgroup"] == (11.0, "ranks [0, 1]")
