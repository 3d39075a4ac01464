"""peagle/demo/tiny_target.py: the test targets' tokenizer corpus is a function of the code alone."""

from __future__ import annotations

import subprocess
import sys

CORPUS_HASH = ("import hashlib; {imports}from peagle.demo.tiny_target import tokenizer_corpus; "
               "print(hashlib.sha256('\\x00'.join(tokenizer_corpus()).encode()).hexdigest())")


def test_the_corpus_does_not_depend_on_what_the_process_imported() -> None:
    """Importing submodules (as vLLM and many tests do) once changed every test target's tokenizer,
    so a test passed or failed by which tests ran before it in the same process."""
    def corpus_hash(imports: str) -> str:
        return subprocess.run([sys.executable, "-c", CORPUS_HASH.format(imports=imports)], check=True,
                              capture_output=True, text=True).stdout.strip()

    plain = corpus_hash("")
    assert plain and corpus_hash("import email.mime.text, logging.handlers, unittest.mock, json.tool; ") == plain
