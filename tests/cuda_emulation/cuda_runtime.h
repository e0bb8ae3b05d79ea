// Emulation stand-in for the CUDA runtime header (see emu.h).
#pragma once
#include "emu.h"
