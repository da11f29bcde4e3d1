"""``python scripts/prepare_data.py --input FILE.jsonl [...] --output DIR``: JSONL + images -> WebDataset shards.

Two modes:

* JSONL files (native, LLaVA or caption lines, detected per line) -> ``DIR/shard-NNNNNN.tar`` + ``index/``.
  Image paths are relative to ``--image-root`` (default: the JSONL file's folder) and may not escape it.
* ``--input DIR`` of existing WebDataset shards without an index (e.g. from img2dataset): writes only
  ``index/`` (into ``--output``, which may be DIR itself); the tars are read, never rewritten.

Bad lines/samples never stop a run: each is skipped, counted by reason, and listed in ``DIR/rejected.jsonl``.
Output is deterministic: the same input and tokenizer give byte-identical shards with any ``--workers``.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

EPILOG = """\
examples:
  python scripts/prepare_data.py --input train.jsonl --image-root images/ --output data/mine/train --workers 4
  python scripts/prepare_data.py --input llava.jsonl captions.jsonl --output data/mix --samples-per-shard 2000
  python scripts/prepare_data.py --input shards_from_img2dataset/ --output shards_from_img2dataset/

The tokenizer must be the one training will use (its fingerprint is stored in the index); the default is
the run config's data.tokenizer (the offline demo tokenizer, built if missing).
"""

# Per-process state of worker processes (set by _init_worker).
_STATE: dict = {}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/prepare_data.py",
        description="Turn JSONL + images (or un-indexed WebDataset shards) into an indexed dataset directory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input", nargs="+", required=True, help="JSONL file(s) (.jsonl.gz too), or one directory of .tar shards"
    )
    p.add_argument("--output", required=True, help="output dataset directory")
    p.add_argument("--image-root", default=None, help="folder image paths are relative to (default: the JSONL's)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar shard (default: 1000)")
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes (default: 1)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id (default: the config's data.tokenizer)")
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help="run config(s) giving the default tokenizer, chat format, image tokens and pixel limit (default: tiny_cpu.yaml)",
    )
    p.add_argument(
        "--image-token-count",
        type=int,
        default=None,
        help="image tokens per image of the target model, recorded in the index (default: from --config)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="skip larger images (default: the config's data.max_image_pixels)",
    )
    p.add_argument(
        "--image-check",
        choices=("decode", "header"),
        default="decode",
        help="index-only (--input DIR): decode every image (default) or read only JPEG headers, ~15x faster; an image "
        "damaged past its header is then skipped and counted when training reads it",
    )
    p.add_argument("--allow-absolute-paths", action="store_true", help="accept absolute image paths in JSONL lines")
    return p.parse_args(argv)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# worker side


def _init_worker(
    tokenizer_path: str, chat_format: str, max_pixels: int, allow_absolute: bool, decode: bool = True
) -> None:
    from nanovlm.data.processing import SampleProcessor
    from nanovlm.data.tokenizer import load_tokenizer

    processor = SampleProcessor(load_tokenizer(tokenizer_path), 1, 1, chat_format=chat_format)
    _STATE.update(processor=processor, max_pixels=max_pixels, allow_absolute=allow_absolute)
    _STATE["decode"] = decode


def _init_pool_worker(*args) -> None:
    """Pool workers leave Ctrl-C to the main process (each printed its own KeyboardInterrupt traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(*args)


def _jsonl_work(task: tuple) -> tuple:
    """(key, source, line, image_root) -> ("ok", PreparedSample, source) | ("skip", key, source, reason, detail)."""
    from nanovlm.data.format import SampleError
    from nanovlm.data.prepare import prepare_jsonl_line

    key, source, line, image_root = task
    try:
        sample = prepare_jsonl_line(
            line, key, Path(image_root), _STATE["processor"], _STATE["max_pixels"], _STATE["allow_absolute"]
        )
        return ("ok", sample, source)
    except SampleError as e:
        return ("skip", key, source, e.reason, e.detail)


def _shard_work(path: str):
    """Index one existing shard (``reindex.index_shard``) with this worker's processor and settings."""
    from nanovlm.data.reindex import index_shard

    return index_shard(path, _STATE["processor"], _STATE["max_pixels"], _STATE["decode"])


def _results(fn, tasks: Iterator, workers: int, init_args: tuple, chunksize: int = 8) -> Iterator:
    """Apply ``fn`` to tasks in order, in this process (workers=1) or a pool; order is always the input order."""
    if workers <= 1:
        _init_worker(*init_args)
        yield from map(fn, tasks)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_pool_worker, initargs=init_args) as pool:
        # In bounded chunks: Pool.imap would read the whole input ahead and buffer results without limit.
        while chunk := list(itertools.islice(tasks, 256 * workers)):
            yield from pool.imap(fn, chunk, chunksize=chunksize)


# ----------------------------------------------------------------------------------------------------------
# main side


class Report:
    """Skip accounting: counts by reason and the rejected.jsonl lines, in input order."""

    def __init__(self) -> None:
        self.written = 0
        self.skips: Counter = Counter()
        self.rejected: list[dict] = []

    def skip(self, key: str, source: str, reason: str, detail: str) -> None:
        self.skips[reason] += 1
        self.rejected.append({"key": key, "source": source, "reason": reason, "detail": detail})

    def write_rejected(self, out_dir: Path) -> Path:
        path = out_dir / "rejected.jsonl"
        tmp = path.with_name("rejected.jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in self.rejected:
                f.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path


def _key_stems(files: list[Path]) -> list[str]:
    """A key prefix per input file: its sanitized stem, made unique when two files share a stem (a suffix that
    is itself another file's stem is skipped: a/x, b/x and c/x_1 give x_0, x_2 and x_1)."""
    stems = [re.sub(r"[^A-Za-z0-9_-]", "_", Path(f.name.removesuffix(".gz")).stem) or "input" for f in files]
    counts = Counter(stems)
    taken = {s for s in stems if counts[s] == 1}
    out = []
    for s in stems:
        if counts[s] > 1:
            i = 0
            while f"{s}_{i}" in taken:
                i += 1
            s = f"{s}_{i}"
        taken.add(s)
        out.append(s)
    return out


def _open_input(path: Path):
    """A JSONL input for reading bytes; ``.gz`` files are decompressed on the fly."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _count_lines(files: list[Path]) -> int | None:
    """Samples to expect, for the progress bar; None when an input is a pipe (it can be read only once)."""
    if not all(f.is_file() for f in files):
        return None
    n = 0
    try:
        for f in files:
            with _open_input(f) as fh:
                n += sum(1 for line in fh if line.strip())
    except (OSError, EOFError):  # the pass that reads the samples reports it, with the line
        return None
    return n


def _check_not_json_array(path: Path) -> None:
    """A JSON array (LLaVA's released .json files) is one document, not lines: every line would be a bad sample."""
    if not path.is_file():
        return
    try:
        with _open_input(path) as fh:
            head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except (OSError, EOFError) as e:  # e.g. a .gz that is not gzip
        raise SystemExit(f"error: cannot read {path}: {e}") from None
    if head.startswith(b"["):
        raise SystemExit(
            f"error: {path} holds a JSON array, not JSON Lines (one object per line). Convert it first: python -c "
            f'"import json, sys; [print(json.dumps(o, ensure_ascii=False)) for o in json.load(open(sys.argv[1]))]" '
            f"{path} > {path.with_suffix('.jsonl').name}"
        )


class InputReadError(RuntimeError):
    """An input file could not be read to its end (a truncated .gz, an I/O error)."""


def _jsonl_tasks(files: list[Path], image_root: Path | None) -> Iterator[tuple]:
    for path, stem in zip(files, _key_stems(files)):
        root = str(image_root if image_root is not None else path.parent)
        lineno = 0
        try:
            with _open_input(path) as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():  # blank lines are not samples
                        yield (f"{stem}-{lineno:08d}", f"{path.name}:{lineno}", line, root)
        except (OSError, EOFError) as e:  # a gzip stream cut short, a read error: the input is not all there
            raise InputReadError(f"cannot read {path} past line {lineno}: {e}") from None


def run_jsonl(args, files: list[Path], out_dir: Path, tok_path: str, fingerprint: str, itc: int, report: Report):
    from tqdm import tqdm

    from nanovlm.data.format import SampleError
    from nanovlm.data.prepare import ShardWriter

    image_root = Path(args.image_root) if args.image_root else None
    writer = ShardWriter(out_dir, fingerprint, itc, args.samples_per_shard, created_by="prepare_data")
    init = (tok_path, args.chat_format, args.max_image_pixels, args.allow_absolute_paths)
    shown = sys.stderr.isatty()  # tqdm's disable=None rule: count the lines (a whole extra pass) only for a bar
    bar = tqdm(total=_count_lines(files) if shown else None, unit="sample", desc="prepare", disable=not shown)
    try:
        for res in _results(_jsonl_work, _jsonl_tasks(files, image_root), args.workers, init):
            if res[0] == "ok":
                try:
                    writer.add(res[1])
                    report.written += 1
                except SampleError as e:  # e.g. a duplicate key
                    report.skip(e.key, res[2], e.reason, e.detail)
            else:
                report.skip(*res[1:])
            bar.update(1)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return writer.close()


def run_index_only(args, in_dir: Path, out_dir: Path, tok_path: str, fingerprint: str, itc: int, report: Report):
    """Index existing shards: one task per shard over ``--workers`` processes, resumable (``data/reindex.py``).

    Each finished shard is kept in ``OUT/.index-parts/``, stamped with the shard's size and mtime and the
    settings that decide its rows; a re-run (after a kill) reuses every part whose stamp still matches and
    indexes only the rest. The index is written once at the end (atomically), then the parts are removed.
    """
    from tqdm import tqdm

    from nanovlm.data.index import DatasetIndex
    from nanovlm.data.reindex import PARTS_DIR, load_part, merge, save_part

    shards = sorted(p for p in in_dir.iterdir() if p.is_file() and p.name.endswith(".tar"))
    if not shards:
        raise SystemExit(f"error: no .tar shards in {in_dir}")
    parts = out_dir / PARTS_DIR
    parts.mkdir(parents=True, exist_ok=True)
    settings = [fingerprint, args.max_image_pixels, args.image_check]
    stamps = {str(p): [p.stat().st_size, p.stat().st_mtime_ns, *settings] for p in shards}
    results = {str(p): r for p in shards if (r := load_part(parts, p, stamps[str(p)])) is not None}
    todo = [str(p) for p in shards if str(p) not in results]
    init = (tok_path, args.chat_format, args.max_image_pixels, False, args.image_check == "decode")
    with tqdm(total=len(shards), initial=len(results), unit="shard", desc="index", disable=None) as bar:
        for path, res in zip(todo, _results(_shard_work, iter(todo), args.workers, init, chunksize=1)):
            results[path] = res
            save_part(parts, Path(path), res, stamps[path])
            bar.update(1)
    names = [os.path.relpath(p, out_dir) for p in shards]
    sizes = [stamps[str(p)][0] for p in shards]  # the bytes that were indexed
    entries, blocks = merge(names, sizes, [results[str(p)] for p in shards], report.skip)
    report.written = sum(e.num_samples for e in entries)
    index = DatasetIndex.from_blocks(out_dir, fingerprint, itc, "prepare_data (index only)", entries, blocks)
    index.save()
    shutil.rmtree(parts, ignore_errors=True)
    return index


def _resolve_tokenizer(args, cfg) -> str:
    """The tokenizer path; the config default (the demo tokenizer) is built offline when missing."""
    if args.tokenizer:
        return args.tokenizer
    tok = cfg.data.tokenizer
    if not Path(tok).exists() and Path(tok).name == "tokenizer" and Path(tok).parent.name == "demo":
        from nanovlm.data.demo import ensure_demo_data

        print(f"building the offline demo tokenizer (and demo data) in {Path(tok).parent} ...", file=sys.stderr)
        ensure_demo_data(Path(tok).parent)
    return tok


def _check_inputs(args: argparse.Namespace) -> tuple[list[Path], list[Path]]:
    """The input paths and, among them, the directories of shards; SystemExit naming what is wrong."""
    inputs = [Path(p) for p in args.input]
    for p in inputs:
        if not p.exists():
            raise SystemExit(f"error: input not found: {p}")
    dirs = [p for p in inputs if p.is_dir()]
    if dirs and len(inputs) > 1:
        raise SystemExit("error: give either JSONL files or one directory of WebDataset shards, not both")
    if not dirs:
        for p in inputs:
            if p.name.endswith((".tar", ".tgz", ".tar.gz")):
                raise SystemExit(f"error: {p} is an archive; pass the directory that holds the shards (--input DIR)")
            _check_not_json_array(p)
    if args.image_root and not Path(args.image_root).is_dir():
        raise SystemExit(f"error: --image-root {args.image_root} is not a directory")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise SystemExit(f"error: --output {args.output} is a file; give a directory")
    resolved = [p.resolve() for p in inputs]
    if len(set(resolved)) < len(resolved):  # every sample would be written twice, under two keys
        raise SystemExit("error: the same input file is given more than once")
    return inputs, dirs


def _summarize(
    report, index, out_dir: Path, rejected, elapsed: float, fingerprint: str, itc: int, args, cfg, where: str = ""
) -> int:
    """Print what was written and skipped (``where``: the output as the user named it, a URL for an upload); the
    exit code (1 when nothing could be written)."""
    where = where or str(out_dir)
    total = report.written + sum(report.skips.values())
    print(
        f"wrote {report.written} of {total} samples in {len(index.shards)} shard(s) to {where} ({elapsed:.2f} s, {report.written / max(elapsed, 1e-9):.0f} samples/s)"
    )
    if report.skips:
        print(
            f"skipped {sum(report.skips.values())}: " + ", ".join(f"{r}={n}" for r, n in sorted(report.skips.items()))
        )
        print(f"skipped samples and reasons: {rejected}")
    if report.written == 0:
        # no index: training and the other tools then say the directory is not a dataset, instead of planning an
        # empty one
        from nanovlm.data.index import remove_index

        remove_index(out_dir)
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(report.skips.items())) or "no input samples"
        print(f"error: no sample could be written ({reasons}); see {rejected}", file=sys.stderr)
        return 1
    print(f"index: {where.rstrip('/')}/index (tokenizer {fingerprint}, {itc} tokens per image)")
    limit = cfg.data.max_image_pixels  # 0 = no limit, here and in training
    if limit > 0 and (args.max_image_pixels <= 0 or args.max_image_pixels > limit):
        print(
            f"note: images up to {args.max_image_pixels or 'any number of'} pixels were accepted; training skips "
            f"those over data.max_image_pixels={limit} unless you set it to {args.max_image_pixels} too"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.output or not args.output.strip():
        raise SystemExit("error: --output must not be empty")
    if args.samples_per_shard <= 0 or args.workers <= 0:
        raise SystemExit("error: --samples-per-shard and --workers must be positive")
    inputs, dirs = _check_inputs(args)
    if args.image_check == "header" and not dirs:
        raise SystemExit("error: --image-check header is for --input DIR (indexing shards in place); JSONL input is "
                         "rewritten into shards, so every image is decoded")  # fmt: skip
    from nanovlm.config import ConfigError, image_token_count, load_config
    from nanovlm.data.prepare import publish
    from nanovlm.data.remote import cache_name, default_cache_dir, is_remote, redact
    from nanovlm.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    try:
        cfg = load_config(args.config or ["tiny_cpu.yaml"])
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    itc = args.image_token_count if args.image_token_count is not None else image_token_count(cfg.model)
    if args.max_image_pixels is None:
        args.max_image_pixels = cfg.data.max_image_pixels
    tok_path = _resolve_tokenizer(args, cfg)
    try:
        args.chat_format = cfg.data.chat_format
        fingerprint = tokenizer_fingerprint(load_tokenizer(tok_path), args.chat_format)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot load tokenizer {tok_path!r}: {e}") from None

    remote_out = args.output if is_remote(args.output) else None
    if remote_out and dirs:
        raise SystemExit(
            "error: --output URL writes new shards from JSONL; to index existing shards, index them where they are "
            "(--input DIR --output DIR) and upload the directory"
        )
    # a URL: written here first, then uploaded (shards, then the index)
    staging = Path(cfg.data.cache_dir or default_cache_dir()) / "upload"
    out_dir = staging / cache_name(remote_out) if remote_out else Path(args.output)
    report = Report()
    t0 = time.perf_counter()
    try:
        if dirs:
            index = run_index_only(args, dirs[0], out_dir, tok_path, fingerprint, itc, report)
        else:
            index = run_jsonl(args, inputs, out_dir, tok_path, fingerprint, itc, report)
    except InputReadError as e:  # nothing is indexed from a partly read input
        print(f"error: {e}; fix the input and run the same command again", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the open shard's temp file is gone already; completed shards stay, unindexed
        # an earlier dataset there is intact, or (once a new shard has replaced one of its shards) unindexed
        print(f"\ninterrupted: run the same command again to prepare {out_dir}", file=sys.stderr)
        return 130
    rejected = report.write_rejected(out_dir)
    if remote_out and index is not None and index.num_samples:
        try:
            sent = publish(out_dir, remote_out)
        except (OSError, ValueError) as e:
            print(f"error: uploading to {redact(remote_out)} failed: {redact(str(e))}; run again", file=sys.stderr)
            return 1
        print(f"uploaded {sent / 1e6:.1f} MB to {redact(remote_out)} (shards first, the index last)")
        for staged in [*out_dir.glob("*.tar"), out_dir / "index"]:  # the local copy is not needed again
            shutil.rmtree(staged) if staged.is_dir() else staged.unlink()
    elapsed = time.perf_counter() - t0

    where = redact(remote_out) if remote_out else str(out_dir)
    return _summarize(report, index, out_dir, rejected, elapsed, fingerprint, itc, args, cfg, where)
