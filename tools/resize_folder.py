"""Writes a resized copy of an image-folder dataset, once, for studies that train at a
smaller size than the files.

    python tools/resize_folder.py SRC DST --size 112

Every image under SRC (`<split>/<class>/<file>`, any depth) is decoded with Pillow,
converted to RGB, resized to SIZE x SIZE with Pillow's antialiased bilinear filter
(the filter widens with the scale, as torchvision's `Resize` on PIL images does;
the training pipelines' own resize is TensorFlow's bilinear, which does not) and
written as PNG (lossless) at the same relative path under DST. The training input
pipelines then read files already at the model's size and keep them decoded as
uint8. DST is written under a temporary name and renamed into place when complete,
so an interrupted run leaves no half-written dataset; an existing DST is refused.
"""

import argparse
import os
import shutil
import sys

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


def image_files(root):
    """Paths of the images under `root`, relative to it, sorted."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            if name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return found


def resize_folder(src, dst, size, say=print):
    """Writes every image of `src` resized to `size` x `size` under `dst` (see the
    module docstring); returns the number of images written.

    Raises:
        ValueError: `src` is missing or holds no image, `dst` exists, or `size` is
            not a positive integer.
    """
    from PIL import Image

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer (pixels), got {size!r}.")
    if not os.path.isdir(src):
        raise ValueError(f"{src} is not a folder of images (train/<class>/*.jpg ...).")
    if os.path.exists(dst):
        raise ValueError(f"{dst} exists: give a new folder (nothing is overwritten).")
    files = image_files(src)
    if not files:
        raise ValueError(f"{src} holds no image ({', '.join(IMAGE_EXTENSIONS)}).")
    partial = dst.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # a copy an interrupted run left
    for i, relative in enumerate(files):
        target = os.path.join(partial, os.path.splitext(relative)[0] + ".png")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            with Image.open(os.path.join(src, relative)) as image:
                resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        except (OSError, ValueError, SyntaxError) as error:
            raise ValueError(f"{os.path.join(src, relative)} does not decode ({error}).") from None
        resized.save(target, format="PNG")
        if say and (i + 1) % 2000 == 0:
            say(f"{i + 1} of {len(files)} images resized")
    os.rename(partial, dst)
    if say:
        say(f"{len(files)} images resized to {size}x{size} in {dst}")
    return len(files)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="folder of images (e.g. train/<class>/*.JPEG, val/...)")
    parser.add_argument("dst", help="new folder for the resized copy")
    parser.add_argument("--size", type=int, required=True, help="side of the square output, px")
    args = parser.parse_args(argv)
    try:
        resize_folder(args.src, args.dst, args.size)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
