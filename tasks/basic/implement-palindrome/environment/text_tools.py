def is_palindrome(text: str) -> bool:
    """True if text is a palindrome, ignoring case and anything but letters and digits."""
    raise NotImplementedError
