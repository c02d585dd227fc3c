"""The size of the data parts that tools/gpu/kit.sh cuts: what one device call can
carry beside the working tree and the wheels.

    python tools/gpu/carry.py .gpu/whl      prints the part size in bytes

A call to the lent GPU machine takes at most 64 MiB: the repository's files (tracked,
and untracked ones git does not ignore) and what the call carries, the wheels and one
data part. The tree grows with every study result committed, so the part is what is
left of 64 MiB after the tree, the wheels and a margin for the results committed
before the kit's parts are used, in whole megabytes.
"""

import os
import subprocess
import sys

LIMIT = 64 * 2**20
#: Room for study results committed between cutting the parts and carrying them.
MARGIN = 4_000_000
#: Smaller parts would take more staging calls than a lent session can spare.
MINIMUM = 10_000_000


def tree_bytes(root):
    """Bytes of the files a device call copies from the checkout at `root`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout
    paths = {path for path in listed.decode().split("\0") if path}
    return sum(os.path.getsize(os.path.join(root, path)) for path in paths
               if os.path.isfile(os.path.join(root, path)))


def part_size(tree, wheels, margin=MARGIN):
    """The largest whole number of megabytes that a call carries beside `tree` and
    `wheels` bytes with `margin` to spare; a `ValueError` below `MINIMUM`."""
    size = (LIMIT - tree - wheels - margin) // 1_000_000 * 1_000_000
    if size < MINIMUM:
        raise ValueError(
            f"a device call carries {LIMIT:,} bytes; the working tree ({tree:,}) and the wheels "
            f"({wheels:,}) with a margin of {margin:,} leave {max(size, 0):,} for a data part, "
            f"under the {MINIMUM:,} a staging call should carry: make the committed study "
            "results smaller (most of their bytes are the runs' grad_norms.csv.gz)")
    return size


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python tools/gpu/carry.py WHEEL_DIR (a folder of the wheels a call "
              "carries, .gpu/whl)", file=sys.stderr)
        return 2
    wheels = sum(entry.stat().st_size for entry in os.scandir(argv[0]) if entry.is_file())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        print(part_size(tree_bytes(root), wheels))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
