"""``sparrowd delta``: make, apply, inspect and export patch files."""

from __future__ import annotations

import argparse
import json

from sparrowd.checkpoint import open_checkpoint
from sparrowd.codec import ABSOLUTE, ULP, ULP2
from sparrowd.delta import apply_file, diff_files, export_patch, inspect_patch
from sparrowd.sizes import format_bytes, parse_size

from .checks import path_arg, path_args
from .progress import Progress


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return v


def register(sub) -> None:
    p = sub.add_parser("delta", help="make, apply, inspect and export sparse patch files (.sprw)",
                       description="Work with sparse, bit-exact patch files (.sprw) offline.")
    ds = p.add_subparsers(dest="delta_command", metavar="ACTION", required=True)

    d = ds.add_parser("diff", help="diff two checkpoints into a patch",
                      description="Diff OLD and NEW (safetensors files or Hugging Face model folders) into a patch.")
    d.add_argument("old", metavar="OLD", help="base checkpoint: a .safetensors file or a model folder")
    d.add_argument("new", metavar="NEW", help="new checkpoint, same kind as OLD")
    d.add_argument("-o", "--output", required=True, metavar="PATCH", help="patch file to write (.sprw)")
    d.add_argument("--values", choices=(ULP, ULP2, ABSOLUTE), default=None,
                   help="value mode: 'ulp2' (format 2) codes integer distances between bit patterns and their "
                        "positions against the base's exponents (the smallest; decoding needs the exact base and "
                        "sparrowd's C extension), 'ulp' stores the distances (about 1.6x ulp2's size on real "
                        "AdamW steps; needs the exact base), 'absolute' stores the new bits (idempotent). Default: "
                        "ulp2, or ulp where this install has no C extension")
    d.add_argument("--version", type=_nonneg, default=1, metavar="N", help="version the patch produces (default 1)")
    d.add_argument("--base-version", type=_nonneg, default=None, metavar="M",
                   help="version the patch applies to (default N-1)")
    d.add_argument("--chunk-size", type=_size, default=None, metavar="BYTES",
                   help="target chunk size, e.g. 2M (default 2 MiB; a patch of a few MiB crosses a swarm faster in "
                        "more, smaller chunks: about a sixteenth of it, at least 256K)")
    d.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    d.set_defaults(func=cmd_diff)

    a = ds.add_parser("apply", help="apply a patch to a checkpoint",
                      description="Apply PATCH to BASE and write the result to OUT (a folder when BASE is a folder, "
                                  "in the same sharding). Fingerprints of the base and the result are checked; "
                                  "nothing is written unless everything matches.")
    a.add_argument("base", metavar="BASE")
    a.add_argument("patch", metavar="PATCH")
    a.add_argument("-o", "--output", required=True, metavar="OUT")
    a.add_argument("--force", action="store_true", help="replace OUT if it is an existing folder")
    a.add_argument("-q", "--quiet", action="store_true")
    a.set_defaults(func=cmd_apply)

    i = ds.add_parser("inspect", help="show what a patch holds", description="Verify and summarise a patch.")
    i.add_argument("patch", metavar="PATCH")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_inspect)

    e = ds.add_parser("export", help="decode a patch into safetensors",
                      description="Write the decoded patch as safetensors: <name>.indices and <name>.values per "
                                  "patched tensor, <name>.full per tensor written whole; versions in the metadata.")
    e.add_argument("patch", metavar="PATCH")
    e.add_argument("-o", "--output", required=True, metavar="DECODED")
    e.add_argument("--base", metavar="CHECKPOINT", help="the base checkpoint (needed for an ulp2 patch)")
    e.set_defaults(func=cmd_export)


def default_values() -> str:
    """``delta diff``'s value mode: ulp2, the smallest, where the C extension that codes it is built."""
    from sparrowd.codec import bits

    return ULP2 if bits._native is not None else ULP


def cmd_diff(args) -> int:
    path_args(("OLD", args.old), ("NEW", args.new), ("-o", args.output))
    with open_checkpoint(args.new) as ck:
        n = len(ck)
    prog = Progress(n, "comparing tensors", enabled=None if not args.quiet else False)
    values = args.values or default_values()
    m = diff_files(args.old, args.new, args.output, values=values, version=args.version,
                   base_version=args.base_version, chunk_size=args.chunk_size,
                   progress=lambda name, changed: prog.step(name))
    prog.close()
    if not args.quiet:
        k = m.elements_changed
        bits = 8 * m.patch_bytes / k if k else 0.0
        print(f"wrote {args.output}: v{m.base_version}->v{m.version}, {len(m.tensors)} tensors, {k} elements changed, "
              f"{format_bytes(m.patch_bytes)} in {len(m.chunks)} chunks ({bits:.2f} bits per changed element, "
              f"values {m.values})")
    return 0


def cmd_apply(args) -> int:
    path_args(("BASE", args.base), ("PATCH", args.patch), ("-o", args.output))
    m = apply_file(args.base, args.patch, args.output, force=args.force)
    if not args.quiet:
        print(f"wrote {args.output}: version {m.version} ({len(m.tensors)} tensors touched, "
              f"{m.elements_changed} elements), fingerprints verified")
    return 0


def cmd_inspect(args) -> int:
    s = inspect_patch(path_arg("PATCH", args.patch))
    if args.json:
        print(json.dumps(s.to_json(), sort_keys=True))
        return 0
    rows = [
        ("versions", f"{s.base_version} -> {s.version}"),
        ("value mode", s.values),
        ("tensors", f"{s.tensors_changed} patched, {s.tensors_added} written whole, {s.tensors_removed} removed"),
        ("elements changed", f"{s.elements_changed} of {s.elements_total}"),
        ("density", f"{100 * s.density:.4f} %"),
        ("bytes", f"{s.patch_bytes} ({format_bytes(s.patch_bytes)})"),
        ("bits per changed element", f"{s.bits_per_element:.3f}"),
        ("chunks", f"{s.chunks} ({format_bytes(s.chunk_bytes_min)} to {format_bytes(s.chunk_bytes_max)}), hashes ok"),
    ]
    if s.history is not None:  # only a chain's folders can decode it: they keep the history
        rows.insert(2, ("coded against", f"the change history of versions {', '.join(map(str, s.history))}"))
    for k, v in rows:
        print(f"{k:>26}  {v}")
    return 0


def cmd_export(args) -> int:
    path_args(("PATCH", args.patch), ("-o", args.output), ("--base", args.base))
    m = export_patch(args.patch, args.output, base=args.base)
    print(f"wrote {args.output}: decoded version {m.version} ({len(m.tensors)} tensors)")
    return 0
