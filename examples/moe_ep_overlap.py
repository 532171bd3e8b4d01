"""MoE blocks with expert parallelism under DualPipeV, F&B ops overlapped part by part, on 2 CPU ranks:
torchrun --standalone --nproc-per-node 2 examples/moe_ep_overlap.py

The ranks form a pipeline x expert-parallel mesh: here PP=1 x EP=2 (each rank holds half of every
block's experts; with 4 ranks, set PP = 2). Each step runs with the overlap off, then on, on the same
weights: the losses must be the same (the overlap only reorders independent work). Every rank prints
its losses and the share of its all-to-alls' time in flight that a compute part of the other
micro-batch ran alongside (hidden).
"""
import os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import twinpipe
from twinpipe.launch import init_torchrun_group
from twinpipe.moe import MoEBlock, MoEStage, reduce_dense_grads, expert_counts
from twinpipe.overlap import comm_hidden

PP = 1                                      # pipeline ranks; EP = the ranks / PP
hidden, heads, layers, chunks = 16, 2, 2, 4


def criterion(output, label):
    return torch.nn.functional.mse_loss(output, label)


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    pp, ep = PP, dist.get_world_size() // PP
    mesh = init_device_mesh("cpu", (pp, ep), mesh_dim_names=("pp", "ep"))   # "cuda" with NCCL
    ep_group = mesh["ep"].get_group()
    torch.manual_seed(mesh.get_local_rank("pp"))  # the same dense weights on every EP rank of a stage
    stages = [MoEStage([MoEBlock(hidden, heads, num_experts=4, top_k=2, expert_hidden=32,
                                 shared_hidden=32, score="sigmoid", groups=2, top_groups=1,
                                 route_scale=2.5, swiglu=True, ep_group=ep_group) for _ in range(layers)])
              for _ in twinpipe.stages_of_rank("dualpipev", pp, mesh.get_local_rank("pp"))]
    pipe = twinpipe.DualPipeV(stages, process_group=mesh["pp"].get_group())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(100 + mesh.get_local_rank("ep"))  # each EP rank its own tokens
    x = torch.randn(2 * chunks, 8, hidden)  # (sequences, tokens, hidden)
    y = torch.randn_like(x)
    first = mesh.get_local_rank("pp") == 0
    for step in range(2):
        losses = {}
        for overlap in (False, True):
            for s in stages:
                s.overlap = overlap
                s.fb_events.clear()
                s.zero_grad(set_to_none=True)
            if first:
                loss, _ = pipe.step(x, num_chunks=chunks, criterion=criterion, labels=(y,))  # on pipeline rank 0;
            else:
                # the other pipeline ranks call pipe.step(num_chunks=chunks)
                loss, _ = pipe.step(num_chunks=chunks)
            losses[overlap] = loss
        for s in stages:
            reduce_dense_grads(s, ep_group)      # attention, router, norms, shared experts: summed over EP
        optimizer.step()
        counts = expert_counts(pipe)             # per block: token copies routed to each expert, rows per local slot
        flying, hid = (sum(t) for t in zip(*(comm_hidden(e) for s in stages for e in s.fb_events)))
        if first:
            print(f"step {step}: rank {dist.get_rank()}: losses {losses[True].tolist()}: same with overlap off: "
                  f"{torch.equal(losses[False], losses[True])}: all-to-all hidden {100 * hid / flying:.0f}% "
                  f"of {flying * 1e3:.1f} ms in flight: tokens per expert {next(iter(counts.values()))['routed'].tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/moe_ep_overlap.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
