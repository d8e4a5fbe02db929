"""Imported first by the elastic workers' fork server (see ``forked_workers``): the server leaves the launcher's
session, so a signal to the launcher's process group (Ctrl-C in a terminal, ``timeout``, a batch scheduler's
SIGTERM to the job) reaches the launcher, which makes every worker leave cleanly, and not the server, whose death
would SIGKILL every worker at once. The server still exits with the launcher: when the launcher's end of its
"alive" pipe closes. Importing this module anywhere but in that server would do the same to the importer: nothing
else imports it."""

import os

if os.getpid() != os.getsid(0):  # not already a session leader
    os.setsid()
