"""DualPipe on 4 CPU ranks: torchrun --standalone --nproc-per-node 4 examples/dualpipe.py

Two copies of a P-stage model run in opposite directions: rank r holds stage r of one copy and
stage P-1-r of the other. Rank 0 passes the inputs of the first half of the batch and the labels
of the second half, and gets the second half's losses; rank P-1 the other way round.
"""
import os, sys
import torch, torch.distributed as dist
from torch import nn
import twinpipe
from twinpipe.launch import init_torchrun_group


def make_stage(i):                          # your model, cut into P stages
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
    modules = [twinpipe.defer_weight_grads(make_stage(s)) for s in (rank, P - 1 - rank)]
    pipe = twinpipe.DualPipe(modules)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    num_chunks = 2 * P                      # P micro-batches per direction
    mine = twinpipe.batch_layout("dualpipe", P, rank, num_chunks)  # this rank's part of the batch
    x, y = batch()
    for step in range(3):
        loss, _ = pipe.step(*mine.inputs(x), num_chunks=num_chunks, criterion=loss_fn,
                            labels=mine.labels(y))
        if loss is not None:                # ranks 0 and P-1: one loss per micro-batch
            print(f"step {step}: rank {rank}: micro-batches {list(mine.label_microbatches)}: "
                  f"losses {loss.tolist()}")
        pipe.sync_mirrored_grads()          # both copies of a stage now hold its full gradient
        optimizer.step(); optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/dualpipe.py`: start 4 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
