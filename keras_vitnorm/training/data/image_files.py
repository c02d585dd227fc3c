"""Whether the files of an image folder are whole images, and the error that names them."""

import os


#: Leading bytes of the image formats a folder may hold.
_SIGNATURES = ((b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"),
               (b"GIF89a", "GIF"), (b"BM", "BMP"))

#: Image formats that neither input pipeline reads, by file extension: a folder's files
#: of these are named, not left out without a word.
OTHER_IMAGE_FORMATS = {
    ".tif": "TIFF", ".tiff": "TIFF", ".webp": "WebP", ".jp2": "JPEG 2000", ".heic": "HEIF",
    ".heif": "HEIF", ".avif": "AVIF", ".ppm": "PPM", ".pgm": "PGM", ".pbm": "PBM",
    ".ico": "ICO",
}


def check_image_file(path):
    """Why the file at `path` is not a whole image, or `None` if it looks whole: its
    format's signature and ending, read without decoding (catches truncated files)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(16)
            f.seek(max(0, size - 32))
            tail = f.read()
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    other = OTHER_IMAGE_FORMATS.get(os.path.splitext(path)[1].lower())
    if other:
        return f"is a {other} image; image folders hold JPEG, PNG, GIF or BMP files (convert it)"
    if size == 0:
        return "is empty"
    kind = next((name for signature, name in _SIGNATURES if head.startswith(signature)), None)
    if kind is None:
        return f"is not a JPEG, PNG, GIF or BMP image (it starts with {head[:8]!r})"
    whole = {
        "JPEG": b"\xff\xd9" in tail,
        "PNG": b"IEND" in tail,
        "GIF": tail.rstrip(b"\x00").endswith(b"\x3b"),
        "BMP": len(head) >= 6 and int.from_bytes(head[2:6], "little") <= size,
    }[kind]
    return None if whole else f"is a truncated {kind} (its end is missing)"


def list_bad_files(bad, shown=5):
    listed = "; ".join(f"{path} {why}" for path, why in bad[:shown])
    return listed + (f"; and {len(bad) - shown} more" if len(bad) > shown else "")


def unreadable_file_error(bad):
    """The `ValueError` for unreadable images `[(path, why), ...]` of a folder dataset."""
    return ValueError(
        f"{len(bad)} file(s) of the dataset folder cannot be used as images: "
        f"{list_bad_files(bad)}. Remove or replace them, or pass --skip-bad-images to train "
        "without them."
    )
