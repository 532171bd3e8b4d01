"""DualPipeV on 4 CPU ranks: torchrun --standalone --nproc-per-node 4 examples/dualpipev.py"""
import os, sys
import torch, torch.distributed as dist
from torch import nn
import twinpipe
from twinpipe.launch import init_torchrun_group


def make_stage(i):                          # your model, cut into 2P stages
    torch.manual_seed(i)                    # the same weights on every rank
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh())


def loss_fn(output, label):
    return nn.functional.mse_loss(output, label)


def batch():                                # one full batch: 64 rows of 16 features
    torch.manual_seed(0)
    return torch.randn(64, 16), torch.randn(64, 16)


def main():
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    rank, P = dist.get_rank(), dist.get_world_size()
    # rank r holds stages r and 2P-1-r (rank 0: the first and the last)
    stages = twinpipe.stages_of_rank("dualpipev", P, rank)
    pipe = twinpipe.DualPipeV([twinpipe.defer_weight_grads(make_stage(s)) for s in stages])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = batch()
    for step in range(3):
        if rank == 0:                       # the inputs and labels of the whole batch
            loss, _ = pipe.step(x, num_chunks=2 * P, criterion=loss_fn, labels=(y,))
            print(f"step {step}: losses {loss.tolist()}")  # one loss per micro-batch
        else:
            pipe.step(num_chunks=2 * P)
        optimizer.step(); optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/dualpipev.py`: start 4 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
