"""`python -m libssm demo`: trains a small Mamba language model (libssm.torch.MambaLMHeadModel)
on selective copying, a task that needs memory: a context of noise tokens hides a few data
tokens, and after a separator the model must say them in order. It then generates the answers
of held-out examples through the decode path (the prompt through the full-sequence kernels,
each answer token through Mamba.step) and reports their accuracy, the training step time and
tokens/s, and the training step time of a pure-PyTorch reference (_mamba_reference) of the same
model with the same weights. Examples are generated on the fly from seeded generators."""

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from . import _mamba_reference
from ._torch_mamba_lm import MambaConfig, MambaLMHeadModel

NOISE, SEPARATOR, FIRST_DATA = 0, 1, 2  # token ids; data tokens are FIRST_DATA .. + vocab - 1
WARMUP_STEPS = 3  # steps left out of the step-time median: they allocate and warm caches


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m libssm demo",
        description="Train a small Mamba LM on selective copying with libssm's kernels, "
                    "generate with the decode path, and compare step times with a "
                    "pure-PyTorch reference of the same model.")
    # With these defaults the model learns the task in a jump at 500-700 steps and ends at
    # 91-99.8% held-out token accuracy (seeds 0-2); a run takes about 90 s on the 2-core
    # development machine.
    p.add_argument("--steps", type=int, default=800, help="training steps (default 800)")
    p.add_argument("--batch", type=int, default=32, help="sequences a step (default 32)")
    p.add_argument("--seqlen", type=int, default=32,
                   help="tokens a training sequence: context, separator and the answer but "
                        "its last token (default 32)")
    p.add_argument("--copy", type=int, default=4,
                   help="data tokens hidden in the context, to be copied; 2 or more, so "
                        "generation takes decode steps (default 4)")
    p.add_argument("--vocab", type=int, default=8, help="distinct data tokens (default 8)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="Mamba blocks (default 2)")
    p.add_argument("--d-state", type=int, default=16, help="SSM state size (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype: bfloat16 trains under autocast with float32 weights "
                        "and generates with bfloat16 weights (default float32)")
    p.add_argument("--eval", type=int, default=256, help="held-out examples (default 256)")
    p.add_argument("--ref-steps", type=int, default=5,
                   help="training steps timed on the pure-PyTorch reference (default 5)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and the examples (default 0)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "copy", "vocab", "d_model", "layers", "d_state", "eval",
                 "ref_steps"):
        if getattr(args, name) < 1:
            p.error("--%s: expected a positive number, got %d"
                    % (name.replace("_", "-"), getattr(args, name)))
    if args.copy < 2:
        p.error("--copy: expected 2 or more (the first answer token comes from the prompt's "
                "forward, the others from decode steps), got %d" % args.copy)
    if args.seqlen < 2 * args.copy:
        p.error("--seqlen: expected at least 2 * --copy = %d (a context with room for the data "
                "tokens, the separator and the answer but its last token), got %d"
                % (2 * args.copy, args.seqlen))
    return args


def make_examples(generator, count, context, n_copy, vocab):
    """(count, context + 1 + n_copy) token ids: the context (noise with n_copy data tokens at
    random distinct positions, in order), the separator, then the data tokens again."""
    positions = torch.rand(count, context, generator=generator).argsort(dim=1)[:, :n_copy]
    positions = positions.sort(dim=1).values
    data = torch.randint(FIRST_DATA, FIRST_DATA + vocab, (count, n_copy), generator=generator)
    tokens = torch.full((count, context), NOISE).scatter_(1, positions, data)
    return torch.cat([tokens, torch.full((count, 1), SEPARATOR), data], dim=1)


class Progress:
    """A progress bar with the loss on stderr: tqdm's when it is installed, else one line
    redrawn with a carriage return (on a terminal) or a line every tenth of the run."""

    def __init__(self, total):
        self.total, self.done, self.last_draw = total, 0, 0.0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc="training", unit="step", file=sys.stderr)

    def update(self, loss):
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix(loss="%.4f" % loss, refresh=False)
            self.bar.update(1)
            return
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw < 0.1 and self.done < self.total:
                return
            end = "\n" if self.done == self.total else ""
        elif self.done % max(1, self.total // 10) and self.done < self.total:
            return
        else:
            end = "\n"
        self.last_draw = now
        width = 30
        filled = width * self.done // self.total
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write("%straining %*d/%d [%s%s] loss %.4f  %.1f step/s%s"
                         % ("\r" if self.tty else "", len(str(self.total)), self.done,
                            self.total, "#" * filled, "." * (width - filled), loss, rate, end))
        sys.stderr.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()


class Timer:
    """Wall-clock seconds of a block, the device's queued work included."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def libssm_logits(model, inputs, n_last):
    return model(inputs, num_last_tokens=n_last).logits


def reference_logits(model, inputs, n_last):
    return _mamba_reference.lm_forward(model, inputs)[:, -n_last:]


def train_step(model, optimizer, logits_of, batch, n_copy, autocast):
    """One AdamW step on the cross-entropy of the answer tokens; returns the loss."""
    with autocast:
        logits = logits_of(model, batch[:, :-1], n_copy)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           batch[:, -n_copy:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def main(argv):
    args = parse_args(argv)
    device = torch.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    context = args.seqlen - args.copy
    length = context + 1 + args.copy  # an example; training sees all but its last token

    def examples(generator, count):
        return make_examples(generator, count, context, args.copy, args.vocab).to(device)

    torch.manual_seed(args.seed)
    config = MambaConfig(d_model=args.d_model, n_layer=args.layers,
                         vocab_size=FIRST_DATA + args.vocab, ssm_cfg={"d_state": args.d_state})
    model = MambaLMHeadModel(config, device=device)
    train_data = torch.Generator().manual_seed(args.seed)
    held_out = examples(torch.Generator().manual_seed(args.seed + 1), args.eval)
    where = ("%s (%s)" % (device, torch.cuda.get_device_name(device)) if device.type == "cuda"
             else str(device))
    print("libssm demo: selective copying, %d of %d data tokens hidden in %d noise tokens, "
          "then copied after a separator (chance %.1f%% a token)"
          % (args.copy, args.vocab, context, 100.0 / args.vocab))
    print("model: libssm.torch.MambaLMHeadModel, %d layers, d_model %d, d_state %d, %s "
          "parameters; %s on %s; batch %d x %d tokens"
          % (args.layers, args.d_model, args.d_state,
             format(sum(p.numel() for p in model.parameters()), ","), args.dtype, where,
             args.batch, args.seqlen),
          flush=True)  # before the progress on stderr

    optimizer = adamw(model, args.lr)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / args.steps))
    progress = Progress(args.steps)
    step_times, losses = [], []
    with Timer(device) as training:
        for _ in range(args.steps):
            batch = examples(train_data, args.batch)
            with Timer(device) as step:
                loss = train_step(model, optimizer, libssm_logits, batch, args.copy, autocast)
            step_times.append(step.seconds)
            schedule.step()
            losses.append(loss.item())
            progress.update(losses[-1])
    progress.close()

    # Generation runs in the compute dtype itself (weights cast, as for inference), where
    # training kept float32 weights under autocast.
    decoder = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    with Timer(device) as decoding:
        generated = decoder.generate(held_out[:, :context + 1], max_length=length)
    hits = generated[:, -args.copy:] == held_out[:, -args.copy:]
    with torch.no_grad(), autocast:
        ours = libssm_logits(model, held_out[:, :-1], args.copy).float()
        theirs = reference_logits(model, held_out[:, :-1], args.copy).float()
    agreement = (ours - theirs).abs().max().item()

    # The reference trains a copy, so the model evaluated above is not disturbed; its first
    # step warms up and is not counted.
    reference = copy.deepcopy(model)
    ref_optimizer = adamw(reference, args.lr)
    ref_times = []
    for _ in range(args.ref_steps + 1):
        batch = examples(train_data, args.batch)
        with Timer(device) as step:
            train_step(reference, ref_optimizer, reference_logits, batch, args.copy, autocast)
        ref_times.append(step.seconds)

    step = statistics.median(step_times[WARMUP_STEPS:] or step_times)
    ref_step = statistics.median(ref_times[1:])
    tokens = args.batch * args.seqlen
    last = statistics.mean(losses[-max(1, args.steps // 20):])
    print("trained %d steps in %.1f s: loss %.3f -> %.3f"
          % (args.steps, training.seconds, losses[0], last))
    print("held-out accuracy, %d examples generated greedily through the decode path: "
          "%.1f%% of tokens, %.1f%% of whole answers (chance %.1f%% a token)"
          % (args.eval, 100.0 * hits.float().mean().item(),
             100.0 * hits.all(dim=1).float().mean().item(), 100.0 / args.vocab))
    print("training step (median): libssm %.2f ms, %s tokens/s; pure-PyTorch reference "
          "%.2f ms, %s tokens/s; libssm %.1fx faster"
          % (1e3 * step, format(round(tokens / step), ","), 1e3 * ref_step,
             format(round(tokens / ref_step), ","), ref_step / step))
    print("generation (%s): %d sequences, each a %d-token prompt through the full-sequence "
          "path and %d decode steps, in %.3f s (%s generated tokens/s)"
          % (args.dtype, args.eval, context + 1, args.copy - 1, decoding.seconds,
             format(round(args.eval * args.copy / decoding.seconds), ",")))
    print("reference check: same weights, max |libssm - reference| over the answer logits "
          "%.1e" % agreement)
    return 0
