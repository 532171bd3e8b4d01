"""Compiled, activation-checkpointed stages under DualPipeV (zero bubble: W deferred), on 2 CPU ranks:
torchrun --standalone --nproc-per-node 2 examples/compile_checkpointing.py

Each stage is `checkpoint(torch.compile(stage))`: its activations are recomputed in the backward, its
weight gradients still run later as W ops. With the aot_eager backend the losses are one eager
process's, bit for bit (docs/compose.md says when and why); "inductor" (the default backend, which
needs a C++ compiler on CPU) is within 1e-13 in float64.
"""
import os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint
import twinpipe
from twinpipe import defer_weight_grads
from twinpipe.launch import init_torchrun_group

BACKEND = "aot_eager"


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def make_stage(i):                          # your model, cut into 2P stages
    torch.manual_seed(i)                    # the same weights on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def loss_fn(output, label):
    return nn.functional.mse_loss(output, label)


def batch():                                # one full batch: 32 rows of 16 features
    torch.manual_seed(0)
    return torch.randn(32, 16), torch.randn(32, 16)


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    rank, P = dist.get_rank(), dist.get_world_size()
    my_stages = [make_stage(s) for s in twinpipe.stages_of_rank("dualpipev", P, rank)]
    stages = [Checkpointed(torch.compile(defer_weight_grads(s), backend=BACKEND)) for s in my_stages]
    pipe = twinpipe.DualPipeV(stages)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = batch()
    for step in range(2):
        if rank == 0:                       # the inputs and labels of the whole batch
            loss, _ = pipe.step(x, num_chunks=2 * P, criterion=loss_fn, labels=(y,))
            print(f"step {step}: losses {loss.tolist()}")  # one loss per micro-batch
        else:
            pipe.step(num_chunks=2 * P)
        optimizer.step(); optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/compile_checkpointing.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
