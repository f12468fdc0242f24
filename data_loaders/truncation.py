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


def check_truncation_lengths(min_truncation_length: int, longest: int | None, block_size: int) -> tuple[int, int]:
    """(shortest, longest) truncation: `longest` (None: ⌊7B/8⌋) lowers how much of a document is ever read, so
    a model with room for long question–answer examples still reads documents as a smaller block would."""
    limit = max_truncation_length(block_size)
    longest = limit if longest is None else longest
    if isinstance(longest, bool) or not isinstance(longest, int) or not MIN_DOCUMENT_LENGTH <= longest <= limit:
        raise ValueError(
            f"max_truncation_length must lie in {MIN_DOCUMENT_LENGTH}..{limit} (⌊7·block_size/8⌋ for block_size "
            f"{block_size}), got {longest!r}"
        )
    shortest = check_min_truncation_length(min_truncation_length, block_size)
    if shortest > longest:
        raise ValueError(f"min_truncation_length {shortest} exceeds max_truncation_length {longest}")
    return shortest, longest


__all__ = [
    "MIN_DOCUMENT_LENGTH",
    "check_min_truncation_length",
    "check_truncation_lengths",
    "max_truncation_length",
]
