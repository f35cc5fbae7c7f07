"""Imported by the process that loader workers fork from (project.data.loader_workers), and by nothing else:
it makes that process end with the training process that started it.

torch's workers watch their parent and end when it does. Forked from a server, a worker's parent is the
server, and the server lives as long as any of its workers does. So without this, a training process
killed outright (SIGKILL, out of memory, a failed rank's launcher ending the job) would leave the server
and its workers running for good, holding open the console the run printed to.
"""

from project.runtime.processes import die_with_parent

die_with_parent()
