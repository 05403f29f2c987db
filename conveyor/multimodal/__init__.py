"""Images in: decoded and checked inputs (image_input.py), each vision family's processor and tower, and the
plumbing that puts a tower's output into the text model's prefill (issue #42, docs/vision.md)."""
