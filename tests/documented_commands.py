"""Every command README.md and docs/*.md show, and what CI runs for it: the one list.

``tests/test_documented_commands.py`` finds the commands in the docs (fenced blocks without a
language or in bash/sh/console/shell: lines that start with ``twinpipe``, ``python``, ``torchrun``,
``pip`` or ``$ ``, continuation lines joined, a trailing ``# comment`` and extra spaces dropped;
inline code that starts with ``twinpipe ``, ``torchrun ``, ``python examples/``, ``python bench/`` or
``python -m twinpipe``) and fails when one is not ``shown`` here, or when an entry here is no
longer in the docs. Then it runs each entry as a user types it, in a fresh folder.

An entry: ``shown``, the command exactly as the docs show it (normalised as above); ``run``, the
shell line CI runs when it must differ, and ``why`` it differs; ``files`` it must write (relative to
its folder: ``.json`` must parse, ``.png`` must open as a picture, ``.csv`` must have rows, a path
ending in ``/`` is a checkpoint folder whose metadata must load); ``stdout``, text its output must
contain; ``folder``, a name shared by entries that run one after another in one folder (a later one
reads what an earlier one wrote), in list order; ``copy``, folders of the repository the command
names (``examples``, ``bench``), copied into its fresh folder first; ``not_run``, why CI does not run
it at all. Entries whose ``run`` is the same line in the same folder run once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    shown: str
    run: str | None = None
    why: str = ""
    files: tuple[str, ...] = ()
    stdout: tuple[str, ...] = ()
    folder: str = ""
    copy: tuple[str, ...] = ()
    not_run: str = ""

    @property
    def line(self) -> str:
        """What CI runs."""
        return self.shown if self.run is None else self.run

    @property
    def place(self) -> str:
        """The folder it runs in (its own, unless it shares one)."""
        return self.folder or self.line


# Why a command runs differently in CI; each entry says which applies.
MENTION = "named in a sentence, not a command to run as it stands: CI checks the command exists and its help lists every option the sentence names"
BENCH = "a benchmark (minutes of timing runs): CI does not run it, only checks that the script starts and its help lists every option shown"
PLACEHOLDERS = "shown with placeholders: CI fills them in"
FOUR_ON_TWO = "4 processes on CI's 2 cores take long: 2 processes"
TRAIN_SMALL = "the documented run takes minutes: 2 processes (the same schedule), a 2-block model of width 16, 2 steps"
NO_GPU = "CI has no GPU: --device cpu (the default)"
MOE_TINY = "--pp 1 --ep 2 --steps 1 --microbatches 2 --microbatch-size 1 --blocks-per-stage 1 --dim 16 --experts 2 --expert-ffn 16"
MOE_DEMO = f"twinpipe demo --moe --trace fb.json {MOE_TINY}"  # test_moe_demo checks this run too
MOE_SMALL = "PP=2 x EP=2 is 4 processes on CI's 2 cores: PP=1 x EP=2, one step of a tiny model"
EPLB_TINY = ("--pp 1 --ep 2 --steps 2 --microbatches 2 --microbatch-size 1 --blocks-per-stage 1 --dim 16 --experts 4 "
             "--expert-ffn 16 --interval 1")
TINY = "--layers 2 --dim 16 --heads 2 --seq-len 16 --batch-size 4 --corpus-bytes 65536"
TRAIN_MOE = f"twinpipe train --experts 4 --top-k 2 --pp 1 --dp 2 --steps 2 {TINY}"  # test_train_moe checks this run too
DATA_TINY = "--layers 2 --dim 16 --heads 2 --seq-len 16 --batch-size 4"
DATA_SMALL = "the documented run takes minutes: 2 steps of a small model (the same processes and schedule)"
TORCHRUN_TRAIN = (f"torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m twinpipe.train --pp 2 --steps 2 {TINY} "
                  "--resume auto")
TRAIN_FILES = ("twinpipe-train/train-loss.png", "twinpipe-train/train-log.json", "twinpipe-train/checkpoint-final/")
LOADS_CSV = "90,132,40,61,104,165,39,4,73,56,183,86", "20,107,104,64,19,197,187,157,172,86,16,27"
TRACE_FILES = ("out/trace.json", "out/measured.png", "out/predicted.png", "out/compare.png")


FREE_PORT = "P=$(python -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])\")"
TWO_NODES = ("the nodes are two torchrun agents on this machine (127.0.0.1, a free port; TWINPIPE_HOST_ID node0 and node1, so "
             "they share no memory, as two machines), one CPU process each (CI has no GPU): PP=2, a tiny model, 2 steps; "
             "--out a folder both see")
NODES_FILES = ("shared/gpt/train-log.json", "shared/gpt/checkpoint-final/")  # the checkpoint holds both nodes' shards


def _two_nodes(agent: str) -> str:
    """CI's line for a multi-node torchrun command: ``agent`` (its options, ``{node}`` for the node's
    rank, ``$P`` the port) started twice on this machine, each with its own host identity; it fails
    when either agent fails."""
    train = f"-m twinpipe.train --pp 2 --steps 2 {TINY} --out shared/gpt"
    first, second = (f"TWINPIPE_HOST_ID=node{n} torchrun {agent.format(node=n)} {train}" for n in (0, 1))
    return f"{FREE_PORT}; {first} & a=$!; {second}; b=$?; wait $a && test $b = 0"


def _help(shown: str, why: str = MENTION, copy: tuple[str, ...] = ()) -> Command:
    """A command CI only asks for its help: its first words (up to the first option or placeholder)."""
    words = []
    for word in shown.split():
        if word.startswith("-") or not word.replace("/", "").replace(".", "").replace("_", "").isalnum():
            break
        words.append(word)
    return Command(shown, f"{' '.join(words)} --help", why, stdout=("usage:",), copy=copy)


def _bench(shown: str) -> Command:
    return _help(shown, BENCH, copy=("bench",))


COMMANDS: list[Command] = [
    # ---- README.md: quick start and tests
    Command('pip install "torch==2.13.0" -e . && twinpipe demo', "twinpipe demo",
            "`pip install` is what .ci/run itself runs before the tests", folder="demo",
            stdout=("exact: yes (losses bitwise equal to a single process",)),
    Command("twinpipe demo", folder="demo"),
    Command('pip install "torch==2.13.0" -e ".[test]" && python -m pytest -q',
            not_run=".ci/run runs this line itself: it is the test run that runs this list"),
    _help("twinpipe demo --help"),
    Command("twinpipe demo --moe --help", stdout=("usage: twinpipe demo --moe", "--expert-ffn", "--eplb")),
    Command("twinpipe demo --moe", MOE_DEMO,
            MOE_SMALL + "; with --trace fb.json, so that this run is also the `twinpipe demo --moe --trace fb.json` "
            "line's", files=("fb.json",), stdout=("losses identical",)),
    Command("twinpipe demo --moe --eplb", f"twinpipe demo --moe --eplb {EPLB_TINY}", MOE_SMALL, stdout=("rebalanced",)),
    Command("torchrun --standalone --nproc-per-node 4 -m twinpipe.demo",
            "torchrun --standalone --nproc-per-node 2 -m twinpipe.demo --steps 1", FOUR_ON_TWO + ", one step",
            stdout=("exact: yes",)),
    # ---- README.md: using it
    Command("python examples/dualpipev.py", copy=("examples",), stdout=("step 2: losses",)),
    Command("torchrun --standalone --nproc-per-node 4 examples/dualpipev.py", "python examples/dualpipev.py",
            "the same run: `python examples/dualpipev.py` starts itself under torchrun with exactly these options",
            copy=("examples",)),
    Command("torchrun --standalone --nproc-per-node 4 examples/dualpipe.py",
            "torchrun --standalone --nproc-per-node 2 examples/dualpipe.py", FOUR_ON_TWO, copy=("examples",),
            stdout=("step 2: rank",)),
    Command("twinpipe simulate --compare 1f1b,zb-h1,dualpipe --pp 8 --microbatches 32 --f 1 --b 1 --w 1 --fb 2.5",
            stdout=("dualpipe",)),
    # ---- the commands' names in sentences
    _help("twinpipe simulate"),
    _help("twinpipe draw"),
    _help("twinpipe plan"),
    _help("twinpipe export"),
    _help("twinpipe eplb"),
    _help("twinpipe simulate --help"),
    _help("twinpipe simulate --compare"),
    _help("twinpipe simulate --cores"),
    _help("twinpipe simulate --f/--b/--w/--fb/--comm/--mw"),
    _help("twinpipe simulate --gpt"),
    _help("twinpipe plan --gpt"),
    # ---- docs/memory.md: memory per rank from the GPT's sizes
    Command("twinpipe simulate dualpipev --pp 2 --microbatches 8 --gpt", stdout=("memory per rank",)),
    Command("twinpipe plan --gpt --layers 6 --dim 64 --seq-len 64 --vocab 256 --microbatch-size 2 --gpus 2 --pp 2 --microbatches 8",
            stdout=("memory per rank",)),
    Command("twinpipe simulate dualpipev --pp 2 --microbatches 4 --dp 2 --gpt --experts 4", stdout=("upper bound",)),
    # ---- benchmarks
    _bench("python bench/bench_vs_torch.py"),
    _bench("python bench/bench_vs_torch.py --steps 20"),
    _bench("python bench/bench_floor.py --schedule NAME"),
    _bench("python bench/bench_sim.py"),
    _bench("python bench/bench_memory.py --pp 2"),
    _bench("python bench/bench_memory.py --pp 2 --model hf-llama"),
    _bench("python bench/bench_memory.py --pp 2 --model hf-llama --dynamic-shapes"),
    _bench("python bench/bench_memory.py --pp 2 --no-release losses"),
    _bench('python bench/bench_memory.py --pp 2 --no-release "last message"'),
    _bench("python bench/bench_memory.py --pp 4 --transport process-group --no-release sends"),
    _bench("python bench/bench_draw.py"),
    _bench("python bench/bench_trace.py"),
    _bench("python bench/bench_eplb.py"),
    _bench("python bench/bench_eplb_loop.py"),
    _bench("python bench/bench_eplb_loop.py --steps 10"),
    _bench("python bench/bench_overlap_all.py --blocks 3"),
    _bench("python bench/bench_overlap.py --e2e"),
    _bench("python bench/bench_overlap.py --draw docs/img/moe-overlap-pair.png"),
    _bench("python bench/bench_overlap.py --reps 9 --e2e --draw docs/img/moe-overlap-pair.png"),
    _bench("python bench/bench_train.py"),
    _bench("python bench/bench_train.py --pp 2 --dp 2 --schedules 1f1b,zb-h1,dualpipev,dualpipe --rounds 4 --steps 6 "
           "--layers 4 --dim 64 --overlap-compare"),
    _bench("python bench/bench_plan.py --skip-run"),
    _bench("python bench/bench_plan.py --skip-speed"),
    _bench("python bench/bench_compose.py"),
    _bench("python bench/bench_hf.py"),
    _bench("python bench/bench_hf.py --parts ep --arch deepseek_v3"),
    _bench("python bench/bench_hf.py --hidden 256 --seq 128 --blocks 9"),
    # ---- docs/adding-a-schedule.md, docs/schedules.md
    Command("twinpipe simulate <name> ...", "twinpipe simulate dualpipev --pp 4 --microbatches 8", PLACEHOLDERS,
            stdout=("bubble rate",)),
    Command("twinpipe simulate --compare ...,<name>", "twinpipe simulate --compare 1f1b,dualpipev --pp 4 --microbatches 8",
            PLACEHOLDERS, stdout=("dualpipev",)),
    Command("twinpipe simulate --compare gpipe,1f1b,... --pp P --microbatches M",
            "twinpipe simulate --compare gpipe,1f1b,zb-h1 --pp 4 --microbatches 8", PLACEHOLDERS, stdout=("zb-h1",)),
    Command("twinpipe simulate/draw chimera --pairs 2",
            "twinpipe simulate chimera --pairs 2 --pp 4 --microbatches 8 && "
            "twinpipe draw chimera --pairs 2 --pp 4 --microbatches 8 --out chimera.png",
            "two commands in one, sizes left out: both, with sizes", files=("chimera.png",)),
    # ---- docs/gallery.md (each picture into docs/img/ of a fresh folder)
    *(Command(f"twinpipe draw {args} --out docs/img/schedule-{name}.png", files=(f"docs/img/schedule-{name}.png",))
      for name, args in [
          ("1f1b", "1f1b --pp 4 --microbatches 8"),
          ("zb-h1", "zb-h1 --pp 4 --microbatches 8"),
          ("zb-h2", "zb-h2 --pp 4 --microbatches 12"),
          ("dualpipe", "dualpipe --pp 8 --microbatches 20"),
          ("dualpipe-overlap", "dualpipe --pp 8 --microbatches 20 --fb 2.2 --comm 0.1"),
          ("dualpipev", "dualpipev --pp 4 --microbatches 10"),
          ("chimera", "chimera --pp 4 --microbatches 8 --w 0"),
          ("bitpipe", "bitpipe --pp 4 --microbatches 8"),
          ("bidirectional", "--compare dualpipe,chimera,bitpipe --pp 4 --microbatches 16"),
          ("compare", "--compare 1f1b,zb-h1,zb-h2,dualpipe --pp 4 --microbatches 12"),
          # docs/schedules.md, "Overlapped F&B ops in the 1F1B family"
          ("1f1b-overlap", "1f1b --pp 4 --microbatches 8 --overlap --overlap-warmup 1"),
          ("interleaved-1f1b-overlap", "interleaved-1f1b --pp 4 --microbatches 8 --overlap --overlap-warmup 1 --fb 2"),
          ("zb-h1-overlap", "zb-h1 --pp 4 --microbatches 8 --overlap"),
          ("zbv-overlap", "zbv --pp 4 --microbatches 8 --overlap"),
      ]),
    # ---- docs/plan.md, docs/tracing.md
    Command("twinpipe plan --layers 24 --dim 2048 --seq-len 2048 --gpus 32 --microbatches 32", stdout=("dualpipev",)),
    Command("twinpipe plan --layers 48 --dim 5120 --seq-len 4096 --experts 128 --top-k 8 --expert-ffn 1536 --ep 8 "
            "--gpus 256 --microbatches 64 --pp 16 --plot plan.png", files=("plan.png",)),
    Command("twinpipe plan --layers 24 --dim 2048 --seq-len 2048 --gpus 32 --microbatches 32 --pp 4",
            stdout=("300.1 ms", "307.4 ms", "322.2 ms", "363.5 ms")),  # the table docs/plan.md shows
    Command("twinpipe plan --layers 48 --dim 5120 --seq-len 4096 --experts 128 --top-k 8 --expert-ffn 1536 --ep 8 "
            "--gpus 256 --microbatches 64 --pp 16 --plot docs/img/plan-moe.png", files=("docs/img/plan-moe.png",),
            stdout=("3.54 s", "3.76 s", "4.17 s")),
    Command("twinpipe plan --layers 64 --dim 7168 --seq-len 4096 --vocab 129280 --experts 256 --top-k 8 --expert-ffn 3072 --ep 64 "
            "--optimizer-bytes 8 --zero1 --activation-share 0.5 --gpus 2048 --intra-gbps 160 --inter-gbps 50 "
            "--microbatches 128 --pp 16 --memory-limit 80",  # DeepSeek-V3's inputs: the table docs/plan.md shows
            stdout=("22.75 s", "22.81 s", "23.33 s", "23.71 s", "30.36 s", "37.09 s", "9.2+18.3+5.5+29.1",
                    "at 80 GiB: interleaved-1f1b overlap=True warmup_extra=1 (pp 16 x dp 128) wins")),
    Command("twinpipe plan --layers 64 --dim 7168 --seq-len 4096 --vocab 163840 --experts 384 --top-k 8 --expert-ffn 3072 --ep 16 "
            "--optimizer-bytes 8 --zero1 --activation-share 0.3 --gpus 2048 --intra-gbps 160 --inter-gbps 50 "
            "--microbatches 128 --pp 16 --memory-limit 80",  # Kimi K2's inputs: the table docs/plan.md shows
            stdout=("22.40 s", "22.46 s", "23.03 s", "29.98 s", "36.71 s", "7.3%", "11.6+23.2+4.1+24.6",
                    "over the budget: dualpipe pp=16 needs 95.2 GiB = 23.2+46.5+8.1+17.5 (2 weight copies)")),
    Command("twinpipe export dualpipev --pp 4 --microbatches 8 --format torch-csv --out dualpipev.csv",
            files=("dualpipev.csv",)),
    Command("twinpipe export --list", stdout=("dualpipev: yes",)),
    Command("twinpipe demo --trace out/", "twinpipe demo --trace out/ --pp 2 --steps 1",
            "4 processes on CI's 2 cores take long: 2 ranks, one (traced) step", folder="trace", files=TRACE_FILES),
    Command("twinpipe plan --from-trace out/trace.json", folder="trace", stdout=("dualpipev",)),
    Command("twinpipe plan --from-trace", "twinpipe plan --from-trace out/trace.json",
            "the option named in a sentence: run on the trace `twinpipe demo --trace out/` wrote", folder="trace"),
    # ---- docs/eplb.md, docs/limits.md
    Command("cat loads.csv", f"printf '%s\\n' {' '.join(LOADS_CSV)} > loads.csv && cat loads.csv",
            "the docs show the file the example reads by its content: CI writes those rows first", folder="eplb",
            stdout=LOADS_CSV),
    Command("twinpipe eplb loads.csv --replicas 16 --groups 4 --nodes 2 --gpus 8 --plot docs/img/eplb_example.png",
            folder="eplb", files=("docs/img/eplb_example.png",),
            stdout=("2.1158 (2.3806, layer 1)", "1.2252 (1.2422, layer 1)", "1.1310 (1.1462, layer 0)",
                    "1.1262 (1.1365, layer 0)", "plot written to docs/img/eplb_example.png")),
    Command("twinpipe eplb LOADS --replicas R --groups G --nodes N --gpus P",
            "twinpipe eplb loads.csv --replicas 16 --groups 4 --nodes 2 --gpus 8", PLACEHOLDERS + " (the example's)",
            folder="eplb", stdout=("hierarchical (4 groups -> 2 nodes -> 8 GPUs)",)),
    Command("python -m twinpipe.eplb.cli LOADS ...",
            "python -m twinpipe.eplb.cli loads.csv --replicas 16 --groups 4 --nodes 2 --gpus 8 --json",
            PLACEHOLDERS + " (the example's)", folder="eplb", stdout=('"phy2log": [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9',)),
    Command("python -m twinpipe.demo --moe --eplb", "python -m twinpipe.demo --moe --help",
            "the same program as `twinpipe demo --moe --eplb`, run above: CI checks this entry point starts and lists --eplb",
            stdout=("usage:",)),
    # ---- docs/moe-overlap.md
    Command("twinpipe demo --moe --trace fb.json", MOE_DEMO,
            MOE_SMALL + ": one run for this line and README's `twinpipe demo --moe`", files=("fb.json",)),
    # ---- docs/train.md (and the README's `twinpipe train`)
    Command("twinpipe train", f"twinpipe train --pp 2 --steps 10 {TINY}",
            "the documented run takes minutes: 2 processes (the same schedule), a 2-block model of width 16, 10 steps "
            "(the summary docs/train.md quotes averages 10)", folder="train", files=TRAIN_FILES,
            stdout=("bits per byte, first step", "bits per byte, mean of first 10 steps", "bits per byte, mean of last 10 steps")),
    Command("twinpipe train --schedule dualpipe --pp 2 --dp 2 --steps 100", f"twinpipe train --schedule dualpipe --pp 2 --steps 2 {TINY}",
            TRAIN_SMALL, folder="train", files=TRAIN_FILES),
    Command("twinpipe train --resume twinpipe-train/checkpoint-final --steps 600 --schedule 1f1b --pp 2 --dp 2",
            f"twinpipe train --resume twinpipe-train/checkpoint-final --steps 3 --schedule 1f1b --pp 1 --dp 2 {TINY}",
            "the documented run takes minutes: the checkpoint of the line before (step 2) to step 3, on 2 processes "
            "(PP=1 x DP=2: another schedule and mesh than the one that wrote it)", folder="train", files=TRAIN_FILES),
    Command("twinpipe train --experts 8 --top-k 2 --pp 2 --dp 2", TRAIN_MOE,
            TRAIN_SMALL + "; PP=1 x DP=2 (EP=2), 4 experts", folder="train-moe", files=TRAIN_FILES),
    Command("twinpipe train --experts 4 --pp 2 --dp 2 --steps 30", TRAIN_MOE,
            TRAIN_SMALL + "; PP=1 x DP=2 (EP=2): the same run as the line above", folder="train-moe"),
    Command("twinpipe train --experts E --top-k K", TRAIN_MOE,
            PLACEHOLDERS + "; the same run as the lines above", folder="train-moe"),
    Command("twinpipe train --pp 2 --dp 2 --experts 4 --steps 2", TRAIN_MOE,
            TRAIN_SMALL + "; PP=1 x DP=2 (EP=2): the same run as the lines above", folder="train-moe"),
    # ---- docs/deepseek-v3.md
    Command("twinpipe train --experts 4 --score sigmoid --bias-update-speed 0.001 --balance-alpha 0.0001 --mtp-depth 1 "
            "--mtp-weight 0.3 --pp 2 --dp 2",
            "twinpipe train --experts 4 --top-k 2 --score sigmoid --bias-update-speed 0.001 --balance-alpha 0.0001 "
            f"--mtp-depth 1 --mtp-weight 0.3 --pp 1 --dp 2 --steps 2 {TINY}",
            TRAIN_SMALL + "; PP=1 x DP=2 (EP=2), 4 experts", folder="train-ds3", files=TRAIN_FILES),
    _help("twinpipe train --no-overlap-dp"),
    _help("twinpipe train --log-every 20 > train.log"),  # the lines: tests/test_train_logs.py
    _help("twinpipe train --resume"),
    _help("twinpipe train --on-nonfinite skip|raise"),
    _help("twinpipe train --resume DIR --optimizer-hparams checkpoint|current"),
    # ---- docs/precision-zero.md
    Command("twinpipe train --precision bf16-mixed --zero 1 --schedule dualpipe --pp 2 --dp 2 --steps 100",
            f"twinpipe train --precision bf16-mixed --zero 1 --schedule 1f1b --pp 1 --dp 2 --steps 2 {TINY}",
            TRAIN_SMALL + "; PP=1 x DP=2 (ZeRO-1 shards over the 2 replicas)", files=TRAIN_FILES),
    _bench("python bench/bench_precision.py --steps 600 --lr 3e-4 --out docs/img/precision-loss.png"),
    _bench("python bench/bench_zero.py --dps 2,4 --precision bf16-mixed"),
    _bench("python bench/bench_zero.py --dps 2 --pp 2 --schedule dualpipev"),
    _bench("python bench/bench_zero.py --dps 2 --pp 2 --schedule dualpipe --precision bf16-mixed --rounds 1 --steps 1"),
    # ---- docs/train.md: --data and --model
    Command("python -c \"import numpy as np; np.save('tokens.npy', np.random.default_rng(0).integers(0, 128, 100_000)"
            ".astype(np.uint16))\"", folder="train-data", files=("tokens.npy",)),
    Command("twinpipe train --data tokens.npy --pp 2 --steps 50", f"twinpipe train --data tokens.npy --pp 2 --steps 2 {DATA_TINY}",
            DATA_SMALL, folder="train-data", files=TRAIN_FILES, stdout=("bits per token, first step",)),
    Command("twinpipe train --model tests/data/tiny-llama --data tokens.npy --pp 2 --schedule zb-h1 --layout \"E,t*2|t*2,L\" --steps 50",
            "twinpipe train --model tests/data/tiny-llama --data tokens.npy --pp 2 --schedule zb-h1 --layout \"E,t*2|t*2,L\" "
            "--steps 2 --seq-len 16 --batch-size 4", DATA_SMALL, folder="train-data", copy=("tests/data/tiny-llama",),
            files=TRAIN_FILES, stdout=("llama (tests/data/tiny-llama)",)),
    Command("twinpipe train --model tests/data/tiny-deepseek-v3 --data tokens.npy --pp 2 --mtp-depth 1 --steps 50",
            "twinpipe train --model tests/data/tiny-deepseek-v3 --data tokens.npy --pp 2 --mtp-depth 1 --steps 2 --seq-len 16 "
            "--batch-size 4", DATA_SMALL, folder="train-data", copy=("tests/data/tiny-deepseek-v3",), files=TRAIN_FILES,
            stdout=("deepseek_v3 (tests/data/tiny-deepseek-v3)",)),
    Command("twinpipe train --model tests/data/tiny-qwen3-moe --data tokens.npy --pp 1 --dp 2 --ep 2 --schedule 1f1b "
            "--eplb-every 10 --redundant-experts 2 --steps 50",
            "twinpipe train --model tests/data/tiny-qwen3-moe --data tokens.npy --pp 1 --dp 2 --ep 2 --schedule 1f1b "
            "--eplb-every 1 --redundant-experts 2 --steps 2 --seq-len 16 --batch-size 4 --out eplb-run",
            DATA_SMALL + "; a rebalance after every step", folder="train-data", copy=("tests/data/tiny-qwen3-moe",),
            files=("eplb-run/train-log.json", "eplb-run/checkpoint-final/"), stdout=("qwen3_moe (tests/data/tiny-qwen3-moe)",)),
    Command("twinpipe train --model tests/data/tiny-llama --data tokens.npy --pp 2 --steps 50 --save-hf-every 25",
            "twinpipe train --model tests/data/tiny-llama --data tokens.npy --pp 2 --steps 3 --save-hf-every 2 --seq-len 16 "
            "--batch-size 4", "the documented run takes minutes: 3 steps of a small model, a transformers folder after step 2",
            folder="train-data", copy=("tests/data/tiny-llama",),
            files=(*TRAIN_FILES, "twinpipe-train/hf-final/model.safetensors", "twinpipe-train/hf-final/config.json",
                   "twinpipe-train/hf-step2/tokenizer.json"), stdout=("twinpipe-train/hf-final",)),
    Command("twinpipe export-hf twinpipe-train/checkpoint-step25 --model tests/data/tiny-llama --out llama-step25",
            "twinpipe export-hf twinpipe-train/checkpoint-step2 --model tests/data/tiny-llama --out llama-step2",
            "the run above is 3 steps: its checkpoint of step 2", folder="train-data",
            files=("llama-step2/model.safetensors", "llama-step2/config.json", "llama-step2/tokenizer.json"),
            stdout=("wrote llama-step2",)),
    Command("twinpipe export-hf CHECKPOINT --model DIR --out OUT", "twinpipe export-hf --help", MENTION, stdout=("usage:",)),
    _help("twinpipe train --data train.bin --data-dtype uint16"),
    _help("twinpipe train --model DIR --data train.npy --eval-data valid.npy --eval-every 50 --eval-batches 8"),
    _help('twinpipe train --model DIR --data "notes/*.txt"'),
    Command("torchrun --standalone --nproc-per-node 8 -m twinpipe.train --pp 4 --dp 2 --device cuda", TORCHRUN_TRAIN,
            NO_GPU + "; 2 processes, a tiny model, 2 steps; one run with the `--max-restarts 3 ... --resume auto` line "
            "below (in a fresh folder --resume auto starts from step 0, and nothing fails: no restart)", files=TRAIN_FILES,
            stdout=("bits per byte, first step",)),
    # ---- docs/train.md: several machines
    *(Command(f"torchrun --nnodes 2 --node-rank {n} --nproc-per-node 8 --master-addr node0 --master-port 29500 -m twinpipe.train "
              "--pp 8 --dp 2 --device cuda --out /shared/gpt",
              _two_nodes("--nnodes 2 --node-rank {node} --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $P"),
              TWO_NODES + "; one run for both nodes' lines", folder="nodes-static", files=NODES_FILES,
              stdout=("bits per byte, first step",)) for n in (0, 1)),
    Command("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id gpt -m twinpipe.train "
            "--pp 8 --dp 2 --device cuda --out /shared/gpt",
            _two_nodes("--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$P --rdzv-id gpt"),
            TWO_NODES + "; the same line on both", folder="nodes-c10d", files=NODES_FILES, stdout=("bits per byte, first step",)),
    Command("torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m twinpipe.train --pp 4 --resume auto",
            TORCHRUN_TRAIN, FOUR_ON_TWO + ", a tiny model, 2 steps (tests/test_preemption.py kills a rank of such a run)",
            files=TRAIN_FILES,
            stdout=("bits per byte, first step",)),
    # ---- docs/hf.md
    Command("python examples/hf_llama.py", copy=("examples",), stdout=("step 2: loss",)),
    Command("torchrun --standalone --nproc-per-node 2 examples/hf_llama.py", "python examples/hf_llama.py",
            "the same run: `python examples/hf_llama.py` starts itself under torchrun with exactly these options",
            copy=("examples",)),
    _help("twinpipe check --model DIR --schedule dualpipe --pp 2 --ep 2"),
    Command("twinpipe check --model tests/data/tiny-qwen3-moe --schedule dualpipev --pp 2 --ep 2",
            "twinpipe check --model tests/data/tiny-qwen3-moe --schedule dualpipev --pp 1 --ep 2", FOUR_ON_TWO + " (PP=1)",
            copy=("tests/data/tiny-qwen3-moe",), stdout=("every difference is within its bound",)),
    # ---- README.md: the other examples (tests/test_examples.py checks what they print)
    Command("python examples/moe_ep_overlap.py", copy=("examples",), stdout=("same with overlap off: True",)),
    Command("python examples/hf_moe_ep.py", copy=("examples",), stdout=("step 1: rank 1: losses",)),
    Command("python examples/eplb_balancer.py", copy=("examples",), stdout=("rebalance at step 2",)),
    Command("python examples/tracing.py", copy=("examples",), files=("out/trace.json",), stdout=("wrote out/trace.json",)),
    Command("python examples/compile_checkpointing.py", copy=("examples",), stdout=("step 1: losses",)),
    Command("python examples/train_loop.py", copy=("examples",), files=("ckpt-step3/",), stdout=("saved ckpt-step3",)),
]
