"""An easy reward for the end-to-end test: answers that start with the digit 1."""


def starts_with_one(prompt: str, response: str, label: str, metadata: dict) -> float:
    return 1.0 if response.strip().startswith("1") else 0.0
