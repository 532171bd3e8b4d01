"""Your own training loop around twinpipe.train's Trainer, on 2 CPU ranks:
torchrun --standalone --nproc-per-node 2 examples/train_loop.py

A small GPT on a (dp, pp) mesh: with 2 ranks one pipeline of 2 stages (with 4 ranks, 2 of them).
The loop stops early and saves a checkpoint on SIGTERM or SIGINT, on every rank at the same step
(twinpipe.train.stopping); else it saves one after the last step. Rank 0 prints each step's global
mean loss and the checkpoint's folder.
"""
import os, sys
import torch, torch.distributed as dist
from twinpipe.train import GPT, GPTConfig, BatchSampler, TrainConfig, Trainer, build_mesh, lm_loss, stdlib_corpus
from twinpipe.launch import init_torchrun_group
from twinpipe.train.checkpoint import save_checkpoint
from twinpipe.train.stopping import STOPPED_EXIT_CODE, StopOnSignals


def main(start=0, steps=3):
    init_torchrun_group("gloo")             # or "nccl"; from torchrun's variables, per restart
    mesh = build_mesh(dp=dist.get_world_size() // 2, pp=2)  # ("dp", "pp"): with 4 ranks, 0,1 are one pipeline, 2,3 the other
    config = TrainConfig(schedule="dualpipe", batch_size=8, microbatch_size=2, max_norm=1.0)
    sampler = BatchSampler(stdlib_corpus(1 << 16), seq_len=16)  # batch `step` is the same on every rank
    trainer = Trainer(lambda: GPT(GPTConfig(seq_len=16, dim=16, heads=2, layers=2)), sampler, lm_loss,
                      lambda params: torch.optim.AdamW(params, lr=3e-3), mesh, config)
    with StopOnSignals(grace=25) as stopper:
        for step in range(start, steps):
            result = trainer.step(step, stop=stopper.requested)
            if mesh.is_first:
                print(step, f"{result.loss:.3f}", {k: f"{v * 1e3:.1f} ms" for k, v in result.times.items()})
            if result.stop:                       # the same on every rank
                stopper.agreed()                  # this rank's grace period starts now if no signal reached it
                save_checkpoint(trainer, f"ckpt-step{step + 1}", step + 1)
                sys.exit(STOPPED_EXIT_CODE)
    save_checkpoint(trainer, f"ckpt-step{steps}", steps)  # loads under any schedule, pp and dp
    if mesh.is_first:
        print(f"saved ckpt-step{steps}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:            # plain `python examples/train_loop.py`: start 2 ranks
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        os.execv(sys.executable, torchrun + sys.argv)
    main()
