"""After training: loading what a run produced and talking to it (inference, prompt-eval).
"""
