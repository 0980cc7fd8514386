# shellcheck shell=bash
# Sourced by launch/torchrun.sh and launch/slurm.sbatch (after their `die`).
#
# check_folder NAME PATH: a folder the script makes later (LOG_DIR), refused now
# in one line where an existing part of its path is a file or cannot be written
# (mkdir's own message would come after the checks passed, and not name NAME).
check_folder() {
    local part=$2
    while [[ ! -e $part && $part != "$(dirname "$part")" ]]; do part=$(dirname "$part"); done
    [[ ! -e $part || -d $part ]] || die "$1 $2: $part is a file, not a folder"
    [[ ! -d $part || -w $part ]] || die "$1 $2: $part is not writable"
}
