"""`python -m project.export`: export a checkpoint as a Hugging Face Llama folder (the work is in project.hf.export)."""

from project.hf.export import main

if __name__ == "__main__":
    main()
