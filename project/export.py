"""`python -m project.export`: export a checkpoint as a Hugging Face Llama folder (the work is in project.hf.export).

The arguments and the output folder are checked before torch is imported, so a mistake is answered at once."""

import sys
from pathlib import Path

from project.hf.export_settings import check_output_dir, parse_args
from project.runtime.arguments import HELP
from project.runtime.errors import exit_on_config_error

if __name__ == "__main__":
    if not set(HELP) & set(sys.argv[1:]):  # the help is the export module's own text
        with exit_on_config_error():
            args = parse_args(sys.argv[1:])
            check_output_dir(Path(str(args["output_dir"])), str(args["overwrite"]).lower() == "true")
    from project.hf.export import main

    main()
