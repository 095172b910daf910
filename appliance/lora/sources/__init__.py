"""Remote adapter sources (s3://, hf://), the allowlist and the bounded disk cache they land in."""
