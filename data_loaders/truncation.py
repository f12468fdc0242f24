"""How much of a document span corruption reads: plain integers, importable without torch (the scripts'
flags and the recipes need them before anything heavy is loaded)."""

MIN_DOCUMENT_LENGTH = 4  # the handouts' shortest truncation, and the shortest document kept


def max_truncation_length(block_size: int) -> int:
    """The longest document prefix an example reads: ⌊7B/8⌋ (the rest of the block holds ⁇ ⁇ and padding)."""
    return (7 * block_size) // 8


def check_min_truncation_length(min_truncation_length: int, block_size: int) -> int:
    max_length = max_truncation_length(block_size)
    if not MIN_DOCUMENT_LENGTH <= min_truncation_length <= max_length:
        raise ValueError(
            f"min_truncation_length must lie in {MIN_DOCUMENT_LENGTH}..{max_length} (⌊7·block_size/8⌋ for "
            f"block_size {block_size}), got {min_truncation_length}"
        )
    return min_truncation_length


__all__ = ["MIN_DOCUMENT_LENGTH", "check_min_truncation_length", "max_truncation_length"]
