"""The live expert balancer on 2 CPU ranks: torchrun --standalone --nproc-per-node 2 examples/eplb_balancer.py

A stage of MoE blocks, built with all 4 experts on every rank, keeps this rank's share of 6 expert
slots (expert parallelism over 2 ranks, 2 redundant slots). The router prefers the last expert, so the
rank that holds it gets most of the tokens; every 2 steps twinpipe.eplb.Balancer measures the loads
and re-places the experts (their weights and optimizer state move between the ranks). Rank 0 prints
each step's loss and max/mean rank load, and each rebalance.
"""
import os, sys
import torch, torch.distributed as dist
from twinpipe.launch import init_torchrun_group
from twinpipe.eplb import Balancer
from twinpipe.moe import MoEBlock, MoEStage
from twinpipe.moe import reduce_dense_grads, reduce_replica_grads

hidden, heads, experts = 16, 2, 4


def make_stage():                           # the same weights on every rank
    torch.manual_seed(0)
    stage = MoEStage([MoEBlock(hidden, heads, num_experts=experts, top_k=2, expert_hidden=32) for _ in range(2)])
    for block in stage.blocks:
        block.router.bias[-1] = 0.5         # every token prefers the last expert
    return stage


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    rank = dist.get_rank()
    ep_group = dist.group.WORLD             # the expert-parallel group: every rank here
    phy2log = [0, 1, 2, 3, 0, 1]            # slot -> expert: experts 0 and 1 twice (rank 0: slots 0-2)
    stage = make_stage()
    stage.shard_experts_(ep_group, phy2log)   # a stage built with all experts keeps this rank's slots
    opt = torch.optim.Adam(stage.parameters())
    balancer = Balancer(stage, optimizer=opt, interval=2, window=2, threshold=1.05)
    torch.manual_seed(1 + rank)             # each rank its own tokens
    data = [(torch.randn(4, 8, hidden), torch.randn(4, 8, hidden)) for _ in range(4)]
    for step, (x, y) in enumerate(data):
        loss = torch.nn.functional.mse_loss(stage(x), y)
        loss.backward()                     # or pipe.step(...)
        reduce_dense_grads(stage, ep_group)     # attention, router, norms, shared experts
        reduce_replica_grads(stage)             # the replicas of one expert: gradients summed
        opt.step(); opt.zero_grad()
        report = balancer.step()                # every `interval` steps: a RebalanceReport
        load = balancer.imbalance()             # per block: max/mean rank load of the window, placement now
        if rank == 0:
            print(f"step {step}: rank 0 loss {loss.item():.4f}: max/mean rank load {[round(r, 2) for r in load]}")
            if report: print(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/eplb_balancer.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
