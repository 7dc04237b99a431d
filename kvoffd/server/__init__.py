"""How the daemon hears and answers, and who is there: the loop, sessions, jobs, admin, HTTP."""
